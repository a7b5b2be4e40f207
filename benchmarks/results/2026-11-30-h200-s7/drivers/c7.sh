set -u
source gpu7/setup.sh
mkdir -p $OUT/host
timeout 200 python3 gpu7/host_prof.py > $OUT/host/host_prof.txt 2>&1; head -12 $OUT/host/host_prof.txt
