set -u
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/gpusite .gpuwheels/b/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/gpusite:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/check $OUT/bk
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, tilelang, deep_gemm; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, tilelang.__version__, deep_gemm.__version__)" 2>&1
  git diff --stat 2>/dev/null | tail -1; } > $OUT/env.txt; cat $OUT/env.txt
timeout 300 python3 scripts/gpu_check.py --quick --sections tilelang-exact,selectors,ranks --ranks-backends tilelang --out $OUT/check > $OUT/check/check.log 2>&1
echo "gpu_check rc=$? PASS $(grep -c PASS $OUT/check/check.log) FAIL $(grep -c FAIL $OUT/check/check.log)"; grep FAIL $OUT/check/check.log | cut -c1-300 | head
OUT=$OUT/bk timeout 150 python3 scripts/bench_kernels.py --arms bf16 --heads 64 > /tmp/bk.log 2>&1; echo "bk rc=$?"; python3 -c "
import json; r=json.load(open('$OUT/bk/bench_kernels.json'))
for x in r['runs']: print(x['H'], x.get('error'), {k: (round(v,3) if isinstance(v,float) else v) for k,v in x.items() if k.endswith('ms') or 'over' in k})"
