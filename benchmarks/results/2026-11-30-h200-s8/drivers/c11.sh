set -u
source gpu8/setup.sh
mkdir -p $OUT/whole
env_txt > $OUT/env.txt; cat $OUT/env.txt
OUT=$OUT/whole timeout 150 python3 gpu8/whole2.py 32 > $OUT/whole/whole.log 2>&1; echo "whole rc=$?"; grep -v "^H[36][24] " $OUT/whole/whole.log | tail -10
