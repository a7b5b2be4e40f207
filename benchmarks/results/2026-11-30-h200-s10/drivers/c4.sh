set -u
source gpu10/setup.sh
mkdir -p $OUT/bk1 $OUT/bk2 $OUT/check $OUT/host
env_txt > $OUT/env.txt; cat $OUT/env.txt
python3 scripts/bench_kernels.py --arms fp8 --heads 32,64 --out $OUT/bk1 > $OUT/bk1/bk.log 2>&1; echo "bk1 rc=$?"
for i in 1 2; do timeout 100 python3 gpu10/host_cold_old.py 32 > $OUT/host/old$i.log 2>&1; echo "old rc=$?"; grep entered $OUT/host/old$i.log; timeout 100 python3 gpu10/host_cold.py 32 > $OUT/host/new$i.log 2>&1; echo "new rc=$?"; grep entered $OUT/host/new$i.log; done
timeout 200 python3 scripts/gpu_check.py --quick --sections selectors,deepgemm --out $OUT/check > $OUT/check/check.log 2>&1
echo "gpu_check rc=$? PASS $(grep -c PASS $OUT/check/check.log) FAIL $(grep -c FAIL $OUT/check/check.log)"; grep FAIL $OUT/check/check.log | cut -c1-200 | head
python3 scripts/bench_kernels.py --arms fp8 --heads 32,64 --out $OUT/bk2 > $OUT/bk2/bk.log 2>&1; echo "bk2 rc=$?"
python3 - <<'PY'
import json, os
for d in ("bk1", "bk2"):
    r = json.load(open(os.path.join(os.environ["OUT"], d, "bench_kernels.json")))
    for row in r["runs"]:
        st = row.get("stages_ms", {})
        print(d, row["H"], {k: round(v, 3) for k, v in row.items() if isinstance(v, float) and ("over" in k or k.endswith("_ms"))},
              {k: round(st[k], 3) for k in ("whole_host_ahead", "whole_do_bench", "select", "score") if k in st})
PY
