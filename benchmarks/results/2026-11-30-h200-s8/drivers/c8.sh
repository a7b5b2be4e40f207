set -u
source gpu8/setup.sh
mkdir -p $OUT/lines
env_txt > $OUT/env.txt; cat $OUT/env.txt
timeout 120 python3 gpu8/line_trace.py > $OUT/lines/line_trace.log 2>&1; echo "rc=$?"; grep -v Warn $OUT/lines/line_trace.log | head -90
