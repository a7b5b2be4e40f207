set -u
source gpu10/setup.sh
mkdir -p $OUT/queue
env_txt > $OUT/env.txt; cat $OUT/env.txt
timeout 150 python3 gpu10/queued_calls.py > $OUT/queue/queue.log 2>&1; echo "queue rc=$?"; cat $OUT/queue/queue.log | tail -12
