set -u
source gpu8/setup.sh
mkdir -p $OUT/slice $OUT/ab
env_txt > $OUT/env.txt; cat $OUT/env.txt
OUT=$OUT/slice timeout 150 python3 gpu8/slice_ab.py 32,64 ways=5 ways=2 > $OUT/slice/slice.log 2>&1; echo "slice rc=$?"; grep -v rep0 $OUT/slice/slice.log | grep -v Warn | tail -16; grep rep0 $OUT/slice/slice.log | cut -c1-200
OUT=$OUT/ab timeout 150 python3 gpu8/ab.py ways=5 > $OUT/ab/ab.log 2>&1; echo "ab rc=$?"; grep -v rep0 $OUT/ab/ab.log | tail -9
