set -u
source gpu7/setup.sh
mkdir -p $OUT/cache
env_txt > $OUT/env.txt; cat $OUT/env.txt
timeout 120 python3 gpu7/trace.py 32 > $OUT/cache/trace_h32_cached.txt 2>&1; grep -n "mqa_logits" $OUT/cache/trace_h32_cached.txt | head -2; tail -1 $OUT/cache/trace_h32_cached.txt
OUT=$OUT/cache timeout 300 python3 gpu7/whole_cache.py 32,64 2>&1 | tee $OUT/cache/whole_cache.log
