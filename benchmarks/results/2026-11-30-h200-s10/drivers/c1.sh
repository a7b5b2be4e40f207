set -u
source gpu10/setup.sh
mkdir -p $OUT/sel $OUT/whole
env_txt > $OUT/env.txt; cat $OUT/env.txt
OUT=$OUT/whole timeout 300 python3 gpu10/wholepf.py 32,64 0,8192,16384,32768 > $OUT/whole/wholepf.log 2>&1; echo "wholepf rc=$?"
grep -v "rep[0-9]" $OUT/whole/wholepf.log | tail -40
OUT=$OUT/sel timeout 200 python3 scripts/bench_select.py --configs default,default+prefetch=8192,default+prefetch=32768,default --phase-config "" > $OUT/sel/sel.log 2>&1; echo "bench_select rc=$?"
grep "cfg=" $OUT/sel/sel.log | cut -c1-120
