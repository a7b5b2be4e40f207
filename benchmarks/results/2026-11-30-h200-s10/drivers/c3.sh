set -u
source gpu10/setup.sh
mkdir -p $OUT/check $OUT/whole $OUT/host
env_txt > $OUT/env.txt; cat $OUT/env.txt
timeout 240 python3 scripts/gpu_check.py --quick --sections serving-kernels,ranks --ranks-backends deepgemm --out $OUT/check > $OUT/check/check.log 2>&1
echo "gpu_check rc=$? PASS $(grep -c PASS $OUT/check/check.log) FAIL $(grep -c FAIL $OUT/check/check.log)"; grep FAIL $OUT/check/check.log | cut -c1-300 | head; grep prepare_fp8 $OUT/check/check.log | cut -c1-120
timeout 120 python3 gpu10/host_cold.py 32 > $OUT/host/host_cold.log 2>&1; echo "host_cold rc=$?"; grep "entered" $OUT/host/host_cold.log
OUT=$OUT/whole timeout 200 python3 gpu10/whole2.py 32,64 > $OUT/whole/whole2.log 2>&1; echo "whole2 rc=$?"; grep -v "rep[0-9]" $OUT/whole/whole2.log | tail -12
