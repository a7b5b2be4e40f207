set -u
source gpu8/setup.sh
mkdir -p $OUT/host
env_txt > $OUT/env.txt; cat $OUT/env.txt
timeout 150 python3 gpu8/host_cold.py 32 > $OUT/host/host_cold.log 2>&1; echo "rc=$?"; grep -v Warn $OUT/host/host_cold.log | tail -75
