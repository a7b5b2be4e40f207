set -u
source gpu8/setup.sh
mkdir -p $OUT/whole $OUT/check $OUT/bk
env_txt > $OUT/env.txt; cat $OUT/env.txt
OUT=$OUT/whole timeout 120 python3 gpu8/whole2.py 32 > $OUT/whole/whole.log 2>&1; echo "whole rc=$?"; grep -v "^H[36][24] " $OUT/whole/whole.log | tail -10
timeout 200 python3 scripts/gpu_check.py --quick --sections ranks --ranks-backends deepgemm --out $OUT/check > $OUT/check/check.log 2>&1
echo "gpu_check rc=$? PASS $(grep -c PASS $OUT/check/check.log) FAIL $(grep -c FAIL $OUT/check/check.log)"; grep FAIL $OUT/check/check.log | cut -c1-300 | head
