set -u
source gpu11/setup.sh
mkdir -p $OUT/ab
env_txt > $OUT/env.txt; cat $OUT/env.txt
OUT=$OUT/ab timeout 280 python3 gpu11/ab4.py 32,64 > $OUT/ab/ab4.log 2>&1; echo "ab4 rc=$?"; cat $OUT/ab/ab4.log
