set -u
source gpu11/setup.sh
mkdir -p $OUT/ab $OUT/sel $OUT/ncu
env_txt > $OUT/env.txt; cat $OUT/env.txt
OUT=$OUT/ab timeout 330 python3 gpu11/ab.py 32,64 1,2,3 > $OUT/ab/ab.log 2>&1; echo "ab rc=$?"
grep -v "rep[0-9]" $OUT/ab/ab.log | grep -v "launch=" | tail -30
grep "launch=" $OUT/ab/ab.log | cut -c1-400
OUT=$OUT/sel timeout 150 python3 scripts/bench_select.py --configs default,default+stages=1,default+stages=2 --phase-config "" > $OUT/sel/sel.log 2>&1; echo "bench_select rc=$?"
grep -i "cfg=\|equal\|mismatch\|FAIL" $OUT/sel/sel.log | cut -c1-160 | head -30
