set -u
source gpu11/setup.sh
mkdir -p $OUT/ab $OUT/ncu
env_txt > $OUT/env.txt; cat $OUT/env.txt
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1); echo "ncu: $NCU"
timeout 200 $NCU -k regex:select_kernel -s 2 -c 1 --import-source yes --section SourceCounters --section WarpStateStats --section SpeedOfLight --section Occupancy --section SchedulerStats --section MemoryWorkloadAnalysis -o $OUT/ncu/new python3 gpu11/ncu_slice.py > $OUT/ncu/new.prof.log 2>&1; echo "ncu rc=$?"; tail -3 $OUT/ncu/new.prof.log
$NCU -i $OUT/ncu/new.ncu-rep --page source --csv --print-source cuda,sass > $OUT/ncu/new.src.csv 2> $OUT/ncu/new.src.err
$NCU -i $OUT/ncu/new.ncu-rep --page details > $OUT/ncu/new.details.txt 2>&1
gzip -f $OUT/ncu/new.src.csv; rm -f $OUT/ncu/new.ncu-rep; ls -la $OUT/ncu
OUT=$OUT/ab timeout 300 python3 gpu11/ab2.py 32 "g4=dict(min_group=4,capg=512);t2k=dict(tile=2048);t8k=dict(tile=8192);r72=dict(maxnreg=72);r96=dict(maxnreg=96)" > $OUT/ab/ab.log 2>&1; echo "ab rc=$?"
grep -v "rep[0-9]" $OUT/ab/ab.log | grep -v "launch=" | tail -12
grep "launch=" $OUT/ab/ab.log | cut -c1-250
