set -u
source gpu11/setup.sh
mkdir -p $OUT/ab $OUT/sel
env_txt > $OUT/env.txt; cat $OUT/env.txt
OUT=$OUT/sel timeout 150 python3 gpu11/fr_rand.py > $OUT/sel/sel.log 2>&1; echo "fr_rand rc=$?"; cat $OUT/sel/sel.log
OUT=$OUT/ab timeout 400 python3 gpu11/ab2.py 32,64 "nosplit=dict(split2=(),split4=())" > $OUT/ab/ab.log 2>&1; echo "ab rc=$?"
grep -v "rep[0-9]" $OUT/ab/ab.log | grep -v "launch=" | tail -16
grep "launch=" $OUT/ab/ab.log | cut -c1-120
