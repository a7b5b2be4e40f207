set -u
source gpu9/setup.sh
mkdir -p $OUT/nccl $OUT/check $OUT/whole $OUT/bk
env_txt > $OUT/env.txt; nvidia-smi -L >> $OUT/env.txt; python3 -c "import torch; print('nccl', torch.cuda.nccl.version())" >> $OUT/env.txt; cat $OUT/env.txt
args="--arms bf16:torch,fp8:deepgemm,fp8:torch --heads 64 --head-dim 128 --dtype bfloat16 --scale"
echo "torchrun --standalone --nproc_per_node 2 tests/multigpu/sharded_check.py $args" > $OUT/nccl/torchrun.log
timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node 2 tests/multigpu/sharded_check.py $args >> $OUT/nccl/torchrun.log 2>&1
echo "torchrun rc=$?" >> $OUT/nccl/torchrun.log; grep -E "PASS|FAIL|rc=" $OUT/nccl/torchrun.log | tail -8
timeout 250 python3 scripts/gpu_check.py --quick --sections serving-kernels,selectors,deepgemm,ranks --ranks-backends deepgemm --out $OUT/check > $OUT/check/check.log 2>&1
echo "gpu_check rc=$? PASS $(grep -c PASS $OUT/check/check.log) FAIL $(grep -c FAIL $OUT/check/check.log)"; grep "FAIL\|expansion" $OUT/check/check.log | cut -c1-200 | head
OUT=$OUT/whole timeout 150 python3 gpu9/whole2.py 32,64 > $OUT/whole/whole.log 2>&1; echo "whole rc=$?"; grep "^H=" $OUT/whole/whole.log
OUT=$OUT/bk timeout 150 python3 scripts/bench_kernels.py --arms fp8 --heads 32,64 > /tmp/bk.log 2>&1; echo "bk rc=$?"; python3 -c "
import json; r=json.load(open('$OUT/bk/bench_kernels.json'))
for x in r['runs']: print(x['H'], {k: (round(v,3) if isinstance(v,float) else v) for k,v in x.items() if k.endswith('ms') or 'over' in k})"
timeout 60 python3 gpu9/trace_cuda.py 32 > /tmp/trace.txt 2>&1; echo "trace rc=$?"; grep -v "Warn\|_warn" /tmp/trace.txt | cut -c1-100 | head -30
