set -u
source gpu11/setup.sh
mkdir -p $OUT/ab $OUT/bk
env_txt > $OUT/env.txt; cat $OUT/env.txt
OUT=$OUT/ab WHOLE_REPS=4 timeout 330 python3 gpu11/ab2.py 32,64 "" > $OUT/ab/ab.log 2>&1; echo "ab rc=$?"
grep -v "launch=" $OUT/ab/ab.log | grep -v "rep[0-9]" | tail -14
timeout 200 python3 scripts/bench_kernels.py --arms fp8 --heads 32,64 --out $OUT/bk > $OUT/bk/bk.log 2>&1; echo "bench_kernels rc=$?"
python3 - <<'P' $OUT/bk/bench_kernels.json
import json, sys
d = json.load(open(sys.argv[1]))
for r in d.get("runs", []):
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if ("over" in k or k.endswith("_ms") or k == "H") and not isinstance(v, dict)})
P
