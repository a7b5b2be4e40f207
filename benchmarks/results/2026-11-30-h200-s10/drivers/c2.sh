set -u
source gpu10/setup.sh
mkdir -p $OUT/sel $OUT/whole
env_txt > $OUT/env.txt; cat $OUT/env.txt
OUT=$OUT/whole timeout 300 python3 gpu10/wholevs.py 32,64 0,2,3,4 > $OUT/whole/wholevs.log 2>&1; echo "wholevs rc=$?"
grep -v "rep[0-9]" $OUT/whole/wholevs.log | grep -v "launch=" | tail -40
grep "launch=" $OUT/whole/wholevs.log | cut -c1-60
OUT=$OUT/sel timeout 200 python3 scripts/bench_select.py --configs default,default+vsteps=0,default+vsteps=2,default --phase-config "" > $OUT/sel/sel.log 2>&1; echo "bench_select rc=$?"
grep "cfg=" $OUT/sel/sel.log | cut -c1-80
