set -u
source gpu8/setup.sh
mkdir -p $OUT/ab $OUT/slice $OUT/whole
env_txt > $OUT/env.txt; cat $OUT/env.txt
OUT=$OUT/slice timeout 150 python3 gpu8/slice_ab.py 32 compact=0 compact=2048 compact=512 maxnreg=96 > $OUT/slice/slice.log 2>&1; echo "slice rc=$?"; grep -v rep0 $OUT/slice/slice.log | tail -20; grep rep0 $OUT/slice/slice.log | cut -c1-400
OUT=$OUT/ab timeout 170 python3 gpu8/ab.py compact=0 compact=2048 compact=512 > $OUT/ab/ab.log 2>&1; echo "ab rc=$?"; grep -v rep0 $OUT/ab/ab.log | tail -16
OUT=$OUT/whole timeout 220 python3 gpu8/whole_ab.py 32,64 > $OUT/whole/whole.log 2>&1; echo "whole rc=$?"; tail -22 $OUT/whole/whole.log
