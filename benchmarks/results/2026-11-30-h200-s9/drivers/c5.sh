set -u
source gpu9/setup.sh
mkdir -p $OUT/check $OUT/whole $OUT/bk1 $OUT/bk2
env_txt > $OUT/env.txt; cat $OUT/env.txt
timeout 200 python3 scripts/gpu_check.py --quick --sections serving-kernels,ranks --ranks-backends deepgemm --out $OUT/check > $OUT/check/check.log 2>&1
echo "gpu_check rc=$? PASS $(grep -c PASS $OUT/check/check.log) FAIL $(grep -c FAIL $OUT/check/check.log)"; grep FAIL $OUT/check/check.log | cut -c1-300 | head
OUT=$OUT/whole timeout 150 python3 gpu9/whole2.py 32,64 > $OUT/whole/whole.log 2>&1; echo "whole rc=$?"; grep "^H=" $OUT/whole/whole.log
for i in 1 2; do
OUT=$OUT/bk$i timeout 150 python3 scripts/bench_kernels.py --arms fp8 --heads 32,64 > /tmp/bk.log 2>&1; echo "bk$i rc=$?"; python3 -c "
import json; r=json.load(open('$OUT/bk$i/bench_kernels.json'))
for x in r['runs']: print(x['H'], {k: (round(v,3) if isinstance(v,float) else v) for k,v in x.items() if k.endswith('ms') or 'over' in k})"
done
