set -u
source gpu7/setup.sh
mkdir -p $OUT/ncu
env_txt > $OUT/env.txt
NCU=/usr/local/cuda/bin/ncu
n=split8
timeout 200 $NCU -k regex:select_kernel -s 2 -c 1 --import-source yes --section SourceCounters --section WarpStateStats --section SpeedOfLight --section Occupancy --section SchedulerStats --section MemoryWorkloadAnalysis -o $OUT/ncu/$n python3 scripts/ncu_select.py "dict()" > $OUT/ncu/$n.prof.log 2>&1
$NCU -i $OUT/ncu/$n.ncu-rep --page source --csv --print-source cuda,sass > $OUT/ncu/$n.src.csv 2>&1
$NCU -i $OUT/ncu/$n.ncu-rep --page details > $OUT/ncu/$n.details.txt 2>&1
$NCU -i /work/main/gpu7/old.ncu-rep --page source --csv --print-source cuda,sass > $OUT/ncu/old.src.csv 2>&1
ls -la $OUT/ncu
