set -u
source gpu7/setup.sh
mkdir -p $OUT/chunks
env_txt > $OUT/env.txt; cat $OUT/env.txt
timeout 300 python3 gpu7/chunks.py 2>&1 | tee $OUT/chunks/chunks.log
