set -u
source gpu8/setup.sh
mkdir -p $OUT/bk2 $OUT/bk3 $OUT/trace
env_txt > $OUT/env.txt; cat $OUT/env.txt
summ() { python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for row in r["runs"]:
    keys = ("H", "whole_ms", "deepgemm_alone_ms", "deepgemm_alone_noclean_ms", "whole_over_deepgemm_alone", "whole_over_deepgemm_alone_noclean", "triton_topk_512_ms", "queries_fp8_ms")
    print({k: (round(row[k], 3) if isinstance(row.get(k), float) else row.get(k)) for k in keys}, "host_ahead", round(row["stages_ms"]["whole_host_ahead"], 3))
PY
}
for d in bk2 bk3; do timeout 200 python3 scripts/bench_kernels.py --arms fp8 --heads 32,64 --out $OUT/$d > $OUT/$d/bk.log 2>&1; echo "$d rc=$?"; summ $OUT/$d/bench_kernels.json; done
timeout 60 python3 gpu8/trace_cuda.py 32 > $OUT/trace/trace_h32_cuda_only.txt 2>&1; echo "trace rc=$?"; sed -n 3,12p $OUT/trace/trace_h32_cuda_only.txt | cut -c1-110; tail -3 $OUT/trace/trace_h32_cuda_only.txt | cut -c1-110
