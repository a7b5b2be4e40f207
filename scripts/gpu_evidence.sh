#!/usr/bin/env bash
# GPU evidence, in parts that fit one device call each. Run from the repository root on
# a CUDA host whose Python can import sp_kpool's GPU packages (see scripts/gpu_wheels.sh).
#   bash scripts/gpu_evidence.sh check   OUTDIR   # pytest tests/gpu (full sizes, gpu.xml) + bench_kernels.py
#   bash scripts/gpu_evidence.sh ranks   OUTDIR   # torchrun NCCL over every GPU, GPU arms, scale options
#   bash scripts/gpu_evidence.sh scale   OUTDIR   # scripts/bench.py under torchrun + parity replays + mpirun
#   bash scripts/gpu_evidence.sh perf    OUTDIR   # bench_kernels.py + scripts/bench.py, library defaults only
#   bash scripts/gpu_evidence.sh chunks  OUTDIR   # the row-local chunks (plan.local_chunks): bench_budget on the
#                                                 # slice (time, peak memory, 2 and 1 GiB) and packed64, and the
#                                                 # GPU tests that check their ids (every rank and layout, fused)
#   bash scripts/gpu_evidence.sh cuda    OUTDIR   # the CUDA scorer (kernels/cuda_fp8_mqa.cu): its GPU tests (bits
#                                                 # of DeepGEMM / the Triton kernel, whole calls), its SASS,
#                                                 # bench_cuda_scorer.py on the slice (FP8 and BF16)
#   bash scripts/gpu_evidence.sh cudawhole OUTDIR # whole calls with SP_KPOOL_CUDA_SCORER=1 against the defaults
#                                                 # (bench_budget.py, +cuda arms: time, peak memory, ids)
#   bash scripts/gpu_evidence.sh cudancu OUTDIR   # ncu of DeepGEMM's kernel and the CUDA scorer's four variants
#                                                 # on the slice (FP8, H 32): throughput, occupancy, stalls
set -uo pipefail
part=$1
out=$2
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# the scripts and tests/multigpu/sharded_check.py import this checkout's package
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
filter() { grep -v "TileLang begins\|TileLang completes\|AnnotateWarpGroupRegAlloc"; }
case $part in
  check)
    SP_KPOOL_GPU_FULL=1 timeout 300 python3 -m pytest tests/gpu -q -rA --junitxml="$out/gpu.xml" 2>&1 | filter > "$out/gpu_tests.log"
    echo "tests/gpu: $(tail -n 1 "$out/gpu_tests.log")"; grep "^FAILED\|^ERROR" "$out/gpu_tests.log" | cut -c1-400
    timeout 200 python3 scripts/bench_kernels.py --torch-baseline --budget 0 --out "$out" 2>&1 | filter > "$out/bench_kernels.log"
    cut -c1-600 "$out/bench_kernels.log"
    ;;
  ranks)
    args="--arms bf16:torch,bf16:tilelang,bf16-serving:tilelang,bf16:triton,bf16-serving:triton,fp8:deepgemm,fp8:torch --heads 64 --head-dim 128 --dtype bfloat16 --scale"
    echo "torchrun --standalone --nproc_per_node $ngpu tests/multigpu/sharded_check.py $args" > "$out/torchrun.log"
    timeout 400 python3 -m torch.distributed.run --standalone --nproc_per_node "$ngpu" tests/multigpu/sharded_check.py $args 2>&1 | filter >> "$out/torchrun.log"
    echo "torchrun rc=$?" >> "$out/torchrun.log"; tail -n 12 "$out/torchrun.log"
    ;;
  scale)
    for arm in tilelang:bf16 deepgemm:fp8; do
      b=${arm%%:*}; p=${arm##*:}
      timeout 150 python3 -m torch.distributed.run --standalone --nproc_per_node "$ngpu" scripts/bench.py --backends "$b" \
        --precisions "$p" --seq-lens 131072 --heads 64 --gathers keys,pools --balances none,causal --out "$out" 2>&1 | filter | tail -n 20
    done
    C=/tmp/kpool_cap/synthetic-call0000.rank000-of-001.safetensors
    timeout 60 python3 -m sp_kpool parity --synthetic --tokens 4096 --device cuda --capture-dir /tmp/kpool_cap --a fp8 --b bf16-serving --out "$out/parity/fp8_vs_bf16-serving" 2>&1 | tail -n 30
    timeout 60 python3 -m sp_kpool parity $C --device cuda --a fp8 --b bf16 --out "$out/parity/fp8_vs_bf16" 2>&1 | tail -n 30
    timeout 60 python3 -m sp_kpool parity $C --device cuda --a bf16-serving --b bf16 --out "$out/parity/bf16-serving_vs_bf16" 2>&1 | tail -n 30
    timeout 60 python3 -m sp_kpool parity $C --device cuda --a fp8 --b fp8:torch --out "$out/parity/fp8_gpu_vs_torch" 2>&1 | tail -n 30
    (cd "$out" && tar czf parity.tgz parity && rm -rf parity)
    if command -v mpirun >/dev/null; then
      timeout 120 mpirun -np "$ngpu" --allow-run-as-root --oversubscribe python3 -m mpi4py scripts/mpirun_smoke.py 2>&1 | tail -n 8 | tee "$out/mpirun.log"
    fi
    ;;
  chunks)
    timeout 170 python3 scripts/bench_budget.py --cases W --heads 32,64 --arms fp8:deepgemm,bf16:triton \
      --budgets 2048,1024 --out "$out" 2>&1 | filter > "$out/bench_budget_W.log"
    mv "$out/bench_budget.json" "$out/bench_budget_W.json" 2>/dev/null
    timeout 60 python3 scripts/bench_budget.py --cases packed64 --heads 32,64 --arms fp8:deepgemm,bf16:triton \
      --budgets 2048 --out "$out" 2>&1 | filter > "$out/bench_budget_packed64.log"
    mv "$out/bench_budget.json" "$out/bench_budget_packed64.json" 2>/dev/null
    grep "^{" "$out"/bench_budget_*.log | cut -c1-420
    timeout 150 python3 -m pytest tests/gpu/test_ranks.py -q -k "deepgemm or triton" --junitxml="$out/ranks.xml" 2>&1 | tail -n 2
    timeout 150 python3 -m pytest tests/gpu/test_fused_fp8.py -q -k "whole_call and not 8192 and not 128" \
      --junitxml="$out/fused_whole_call.xml" 2>&1 | tail -n 2
    ;;
  cuda)
    # the tests first, under a short limit: a wrong pipeline wait hangs rather than fails
    timeout 260 python3 -m pytest tests/gpu/test_cuda_fp8_mqa.py -q -rA -x --junitxml="$out/cuda_fp8_mqa.xml" 2>&1 \
      | filter > "$out/cuda_fp8_mqa.log"
    echo "test_cuda_fp8_mqa rc=${PIPESTATUS[0]}: $(tail -n 1 "$out/cuda_fp8_mqa.log")"; grep "^FAILED\|^ERROR\|Error" "$out/cuda_fp8_mqa.log" | cut -c1-400 | head -n 8
    lib=$(python3 -c "from sp_kpool.kernels import cuda_fp8_mqa as m; print(m.build())" 2>/dev/null)
    if [ -n "$lib" ] && command -v cuobjdump >/dev/null; then
      cuobjdump --dump-sass "$lib" > "$out/cuda_fp8_mqa.sass"
      echo "SASS: QGMMA $(grep -c QGMMA "$out/cuda_fp8_mqa.sass"), HGMMA $(grep -c HGMMA "$out/cuda_fp8_mqa.sass"), HMMA $(grep -c HMMA "$out/cuda_fp8_mqa.sass"), FFMA $(grep -c FFMA "$out/cuda_fp8_mqa.sass"), FMUL $(grep -c FMUL "$out/cuda_fp8_mqa.sass"), FADD $(grep -c FADD "$out/cuda_fp8_mqa.sass")"
      xz -9 "$out/cuda_fp8_mqa.sass"
    fi
    timeout 240 python3 scripts/bench_cuda_scorer.py --heads 32,64 --cases W --out "$out" 2>&1 | filter > "$out/bench_cuda_scorer.log"
    cut -c1-1200 "$out/bench_cuda_scorer.log"
    ;;
  cudancu)
    timeout 540 ncu --clock-control none --target-processes all -k regex:fp8_mqa --section SpeedOfLight \
      --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
      -o "$out/cuda_scorer_ncu" python3 scripts/bench_cuda_scorer.py --profile --cases W --heads 32 --precisions fp8 \
      > "$out/cuda_scorer_ncu.log" 2>&1
    echo "ncu rc=$?"; tail -n 5 "$out/cuda_scorer_ncu.log"
    ncu --import "$out/cuda_scorer_ncu.ncu-rep" --page details --csv > "$out/cuda_scorer_ncu.csv" 2>/dev/null
    python3 - "$out/cuda_scorer_ncu.csv" <<'PY'
import csv, sys
want = ("Duration", "Compute (SM) Throughput", "Memory Throughput", "L2 Cache Throughput", "Achieved Occupancy",
        "Registers Per Thread")
rows = {}
for r in csv.DictReader(open(sys.argv[1])):
    if r.get("Metric Name") in want:
        rows.setdefault((r["ID"], r["Kernel Name"][:60]), {})[r["Metric Name"]] = r["Metric Value"] + " " + r["Metric Unit"]
for (i, name), m in rows.items():
    print(i, name, "|", "; ".join(f"{k}: {m.get(k, '-')}" for k in want))
PY
    ;;
  cudawhole)
    timeout 400 python3 scripts/bench_budget.py --cases W,packed64 --heads 32,64 --budgets 2048 \
      --arms fp8:deepgemm,fp8:deepgemm+cuda,bf16:triton,bf16:triton+cuda --out "$out" 2>&1 | filter > "$out/bench_budget_cuda.log"
    mv "$out/bench_budget.json" "$out/bench_budget_cuda.json" 2>/dev/null
    grep "^{" "$out/bench_budget_cuda.log" | cut -c1-420
    ;;
  perf)
    timeout 200 python3 scripts/bench_kernels.py --torch-baseline --out "$out" 2>&1 | filter > "$out/bench_kernels.log"
    cut -c1-700 "$out/bench_kernels.log"
    for arm in tilelang:bf16 deepgemm:fp8; do
      b=${arm%%:*}; p=${arm##*:}
      timeout 150 python3 -m torch.distributed.run --standalone --nproc_per_node "$ngpu" scripts/bench.py --backends "$b" \
        --precisions "$p" --seq-lens 131072 --heads 64 --gathers keys,pools --balances none,causal --out "$out" 2>&1 | filter | tail -n 6
    done
    ;;
esac
