set -u
source gpu11/setup.sh
mkdir -p $OUT/ab $OUT/check
env_txt > $OUT/env.txt; cat $OUT/env.txt
timeout 90 python3 gpu11/ab5.py > $OUT/ab/ab5.log 2>&1; echo "ab5 rc=$?"; cat $OUT/ab/ab5.log
timeout 300 python3 scripts/gpu_check.py --quick --sections selectors,deepgemm,ranks --ranks-backends deepgemm --out $OUT/check > $OUT/check/check.log 2>&1
echo "gpu_check rc=$? PASS $(grep -c PASS $OUT/check/check.log) FAIL $(grep -c FAIL $OUT/check/check.log)"; grep "FAIL\|NaN" $OUT/check/check.log | cut -c1-200 | head
