set -u
source gpu7/setup.sh
mkdir -p $OUT/ab $OUT/bk
env_txt > $OUT/env.txt; cat $OUT/env.txt
OUT=$OUT/ab timeout 250 python3 gpu7/ab.py num_warps=4 maxnreg=64 num_warps=4+maxnreg=64 search=interp 2>&1 | tee $OUT/ab/ab.log | grep -v "rep0" 
timeout 300 python3 scripts/bench_kernels.py --arms fp8 --heads 32,64 --select-configs "num_warps=4,maxnreg=64,search=interp,search=interp+min_group=4" --out $OUT/bk 2>&1 | grep -v "^{" > $OUT/bk/bk.log
python3 - <<'P' $OUT/bk/bench_kernels.json
import json, sys
d = json.load(open(sys.argv[1]))
for r in d.get("runs", d.get("rows", [])):
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k in ("H", "whole_ms", "deepgemm_alone_ms", "deepgemm_alone_noclean_ms", "whole_over_deepgemm_alone", "whole_over_deepgemm_alone_noclean", "triton_topk_512_ms", "triton_topk_512_configs", "stages_ms", "deepgemm_chunked_noclean_ms", "error")})
P
