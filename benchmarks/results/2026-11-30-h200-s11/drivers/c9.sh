set -u
source gpu11/setup.sh
mkdir -p $OUT/ph
env_txt > $OUT/env.txt
timeout 200 python3 gpu11/ph.py > $OUT/ph/ph.log 2>&1; echo "ph rc=$?"; cut -c1-200 $OUT/ph/ph.log
