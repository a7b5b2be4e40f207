set -u
source gpu8/setup.sh
mkdir -p $OUT/qtune $OUT/bk
env_txt > $OUT/env.txt; cat $OUT/env.txt
timeout 120 python3 gpu8/qtune.py > $OUT/qtune/qtune.log 2>&1; echo "qtune rc=$?"; cat $OUT/qtune/qtune.log | grep -v Warn | tail -24
timeout 330 python3 scripts/bench_kernels.py --arms fp8 --heads 32,64 --out $OUT/bk > $OUT/bk/bk.log 2>&1; echo "bk rc=$?"
python3 - <<'PY'
import json, os
r = json.load(open(os.path.join(os.environ["OUT"], "bk", "bench_kernels.json")))
for row in r["runs"]:
    keys = ("H", "whole_ms", "deepgemm_alone_ms", "deepgemm_alone_noclean_ms", "whole_over_deepgemm_alone", "whole_over_deepgemm_alone_noclean", "deepgemm_chunked_noclean_ms", "triton_topk_512_ms", "queries_fp8_ms")
    print({k: (round(row[k], 3) if isinstance(row.get(k), float) else row.get(k)) for k in keys})
    print({k: round(v, 3) for k, v in row.get("stages_ms", {}).items()})
PY
