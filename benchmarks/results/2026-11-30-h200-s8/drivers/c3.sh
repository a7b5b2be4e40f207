set -u
source gpu8/setup.sh
mkdir -p $OUT/whole $OUT/trace $OUT/check
env_txt > $OUT/env.txt; cat $OUT/env.txt
OUT=$OUT/whole timeout 200 python3 gpu8/whole2.py 32,64 > $OUT/whole/whole.log 2>&1; echo "whole rc=$?"; grep -v "^H[36][24] " $OUT/whole/whole.log | tail -24
timeout 50 python3 gpu8/trace.py 32 > $OUT/trace/trace_h32.txt 2>&1; echo "trace rc=$?"; sed -n 3,40p $OUT/trace/trace_h32.txt | cut -c1-110
timeout 280 python3 scripts/gpu_check.py --quick --sections selectors,deepgemm,ranks --ranks-backends deepgemm --out $OUT/check > $OUT/check/check.log 2>&1
echo "gpu_check rc=$? PASS $(grep -c PASS $OUT/check/check.log) FAIL $(grep -c FAIL $OUT/check/check.log)"; grep FAIL $OUT/check/check.log | cut -c1-300 | head
