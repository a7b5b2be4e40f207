set -u
source gpu8/setup.sh
mkdir -p $OUT/whole $OUT/trace $OUT/host
env_txt > $OUT/env.txt; cat $OUT/env.txt
OUT=$OUT/whole timeout 230 python3 gpu8/whole2.py 32,64 > $OUT/whole/whole.log 2>&1; echo "whole rc=$?"; grep -v "^H[36][24] " $OUT/whole/whole.log | tail -24
timeout 60 python3 gpu8/trace.py 32 > $OUT/trace/trace_h32.txt 2>&1; echo "trace rc=$?"; sed -n 3,45p $OUT/trace/trace_h32.txt
timeout 90 python3 scripts/host_time.py > $OUT/host/host_time.log 2>&1; echo "host_time rc=$?"; tail -15 $OUT/host/host_time.log
