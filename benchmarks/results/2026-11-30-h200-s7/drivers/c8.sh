set -u
source gpu7/setup.sh
mkdir -p $OUT/check $OUT/ab $OUT/whole
env_txt > $OUT/env.txt; cat $OUT/env.txt
timeout 330 python3 scripts/gpu_check.py --quick --sections serving-kernels,selectors,deepgemm,ranks --ranks-backends deepgemm --out $OUT/check > $OUT/check/check.log 2>&1
echo "gpu_check rc=$? PASS $(grep -c PASS $OUT/check/check.log) FAIL $(grep -c FAIL $OUT/check/check.log)"; grep FAIL $OUT/check/check.log | cut -c1-300 | head
OUT=$OUT/ab timeout 200 python3 gpu7/ab.py ways=2 maxnreg=72 2>&1 | tee $OUT/ab/ab.log | grep -v rep0
