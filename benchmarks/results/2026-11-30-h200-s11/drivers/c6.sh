set -u
source gpu11/setup.sh
mkdir -p $OUT/overlap
env_txt > $OUT/env.txt; cat $OUT/env.txt
timeout 120 python3 gpu11/overlap.py > $OUT/overlap/overlap.log 2>&1; echo "overlap rc=$?"; cat $OUT/overlap/overlap.log
