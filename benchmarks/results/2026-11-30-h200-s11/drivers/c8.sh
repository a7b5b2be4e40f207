set -u
source gpu11/setup.sh
mkdir -p $OUT/check
env_txt > $OUT/env.txt; cat $OUT/env.txt
timeout 560 python3 scripts/gpu_check.py --quick --sections serving-kernels,selectors,deepgemm,ranks --ranks-backends deepgemm --out $OUT/check > $OUT/check/check.log 2>&1
echo "gpu_check rc=$? PASS $(grep -c PASS $OUT/check/check.log) FAIL $(grep -c FAIL $OUT/check/check.log)"; grep FAIL $OUT/check/check.log | cut -c1-300 | head
