set -u
source gpu7/setup.sh
mkdir -p $OUT/whole $OUT/trace
env_txt > $OUT/env.txt; cat $OUT/env.txt
timeout 120 python3 gpu7/trace.py 32 > $OUT/trace/trace_h32.txt 2>&1; head -5 $OUT/trace/trace_h32.txt; tail -3 $OUT/trace/trace_h32.txt
OUT=$OUT/whole timeout 400 python3 gpu7/whole_ab.py 32,64 2>&1 | tee $OUT/whole/whole.log | grep -v rep
