set -u
source gpu7/setup.sh
mkdir -p $OUT/host
env_txt > $OUT/env.txt
timeout 120 python3 gpu7/host_steps.py 32 2>&1 | tee $OUT/host/host_steps.txt
