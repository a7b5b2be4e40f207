set -u
source gpu11/setup.sh
mkdir -p $OUT/trace $OUT/expand
env_txt > $OUT/env.txt; cat $OUT/env.txt
timeout 120 python3 gpu11/trace2.py 32 > $OUT/trace/trace_h32.txt 2>&1; echo "trace rc=$?"; tail -28 $OUT/trace/trace_h32.txt
timeout 250 python3 gpu11/ab3.py 1,2,4,8 > $OUT/expand/ab3.log 2>&1; echo "ab3 rc=$?"; cat $OUT/expand/ab3.log | grep -v Warning
