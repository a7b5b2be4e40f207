set -u
source gpu7/setup.sh
mkdir -p $OUT/bk
env_txt > $OUT/env.txt
timeout 150 python3 scripts/bench_kernels.py --arms fp8 --heads 32 --out $OUT/bk 2>&1 | grep -v "^{" > $OUT/bk/bk.log
python3 - <<'P' $OUT/bk/bench_kernels.json
import json, sys
d = json.load(open(sys.argv[1]))
for r in d.get("runs", []):
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k in ("H", "whole_ms", "deepgemm_alone_ms", "deepgemm_alone_noclean_ms", "whole_over_deepgemm_alone", "whole_over_deepgemm_alone_noclean", "triton_topk_512_ms", "stages_ms", "error")})
P
