set -u
source gpu11/setup.sh
mkdir -p $OUT/nccl $OUT/check
env_txt > $OUT/env.txt; nvidia-smi -L >> $OUT/env.txt; python3 -c "import torch; print('nccl', torch.cuda.nccl.version())" >> $OUT/env.txt; cat $OUT/env.txt
args="--arms bf16:torch,fp8:deepgemm,fp8:torch --heads 64 --head-dim 128 --dtype bfloat16 --scale"
echo "torchrun --standalone --nproc_per_node 2 tests/multigpu/sharded_check.py $args" > $OUT/nccl/torchrun.log
timeout 240 python3 -m torch.distributed.run --standalone --nproc_per_node 2 tests/multigpu/sharded_check.py $args >> $OUT/nccl/torchrun.log 2>&1
echo "torchrun rc=$?" >> $OUT/nccl/torchrun.log; grep -E "PASS|FAIL|rc=" $OUT/nccl/torchrun.log | tail -8
timeout 150 python3 scripts/gpu_check.py --quick --sections ranks --ranks-backends deepgemm --out $OUT/check > $OUT/check/check.log 2>&1
echo "gpu_check rc=$? PASS $(grep -c PASS $OUT/check/check.log) FAIL $(grep -c FAIL $OUT/check/check.log)"; grep FAIL $OUT/check/check.log | head
