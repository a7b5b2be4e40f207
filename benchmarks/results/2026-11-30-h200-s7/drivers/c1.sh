set -u
source gpu7/setup.sh
mkdir -p $OUT/sel $OUT/ncu
env_txt > $OUT/env.txt; cat $OUT/env.txt
timeout 240 python3 scripts/bench_select.py --configs "default,default+search=split+min_group=8,default+maxnreg=96,default+maxnreg=128,default+min_group=8,default+search=split,default,default+search=split+min_group=8" --phase-config default --out $OUT/sel 2>&1 | grep -v "^{" | tee $OUT/sel/sel.log | cut -c1-260
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
for cfg in new:"dict()" old:"dict(search='split', min_group=8)"; do
  n=${cfg%%:*}; kw=${cfg#*:}
  timeout 150 $NCU -k regex:select_kernel -s 2 -c 1 --import-source yes --section SourceCounters --section WarpStateStats --section SpeedOfLight --section Occupancy -o $OUT/ncu/$n python3 scripts/ncu_select.py "$kw" > $OUT/ncu/$n.prof.log 2>&1
  tail -3 $OUT/ncu/$n.prof.log
  $NCU -i $OUT/ncu/$n.ncu-rep --page source --csv --print-source cuda,sass > $OUT/ncu/$n.src.csv 2> $OUT/ncu/$n.src.err || $NCU -i $OUT/ncu/$n.ncu-rep --page source --csv > $OUT/ncu/$n.src.csv 2>> $OUT/ncu/$n.src.err
  $NCU -i $OUT/ncu/$n.ncu-rep --page details > $OUT/ncu/$n.details.txt 2>&1
  wc -c $OUT/ncu/$n.*; head -c 600 $OUT/ncu/$n.src.err
done
