set -u
source gpu9/setup.sh
mkdir -p $OUT/check $OUT/whole $OUT/expand $OUT/trace $OUT/bk
env_txt > $OUT/env.txt; cat $OUT/env.txt
timeout 240 python3 scripts/gpu_check.py --quick --sections serving-kernels,ranks --ranks-backends deepgemm --out $OUT/check > $OUT/check/check.log 2>&1
echo "gpu_check rc=$? PASS $(grep -c PASS $OUT/check/check.log) FAIL $(grep -c FAIL $OUT/check/check.log)"; grep FAIL $OUT/check/check.log | cut -c1-300 | head
timeout 90 python3 gpu9/qab.py > $OUT/qab.log 2>&1; echo "qab rc=$?"; tail -8 $OUT/qab.log
OUT=$OUT/whole timeout 200 python3 gpu9/whole2.py 32,64 > $OUT/whole/whole.log 2>&1; echo "whole rc=$?"; grep -v "^H[36][24] " $OUT/whole/whole.log | tail -16
OUT=$OUT/expand timeout 90 python3 scripts/bench_expand.py > $OUT/expand/expand.log 2>&1; echo "expand rc=$?"; python3 -c "
import json; r=json.load(open('$OUT/expand/bench_expand.json'))
for x in r['runs']: print(x['width'], x['tail'], x['launch'], round(x['ms']*1e3,1), 'us', x['equal_default'], round(x['write_gbps']))"
timeout 60 python3 gpu9/trace_cuda.py 32 > $OUT/trace/trace_h32.txt 2>&1; echo "trace rc=$?"; grep -v Warn $OUT/trace/trace_h32.txt | cut -c1-120 | head -40
OUT=$OUT/bk timeout 200 python3 scripts/bench_kernels.py --arms fp8 --heads 32,64 > $OUT/bk/bk.log 2>&1; echo "bk rc=$?"; python3 -c "
import json; r=json.load(open('$OUT/bk/bench_kernels.json'))
for x in r['runs']: print(x['H'], {k: (round(v,3) if isinstance(v,float) else v) for k,v in x.items() if k.endswith('ms') or 'over' in k})"
