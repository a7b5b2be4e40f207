set -u
source gpu10/setup.sh
mkdir -p $OUT/host
env_txt > $OUT/env.txt; cat $OUT/env.txt
for i in 1 2 3; do
  timeout 100 python3 gpu10/host_cold_old.py 32 > $OUT/host/old$i.log 2>&1; echo "old$i rc=$?"; grep entered $OUT/host/old$i.log
  timeout 100 python3 gpu10/host_cold.py 32 > $OUT/host/new$i.log 2>&1; echo "new$i rc=$?"; grep entered $OUT/host/new$i.log
done
