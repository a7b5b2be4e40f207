#!/usr/bin/env bash
# GPU evidence, in parts that fit one device call each. Run from the repository root on
# a CUDA host whose Python can import sp_kpool's GPU packages (see scripts/gpu_wheels.sh).
# Every part is a list of steps, each named by what it measures: every step under its own time
# limit, its output in OUTDIR/STEP.log as it goes and one line "STEP: rc=.. ok|failed|timeout
# (.. s)" appended to OUTDIR/steps.txt, so a hang or a trap loses nothing already done. The
# benchmarks are cases of the one entry `python3 -m sp_kpool.bench CASE` (its --help lists them).
#   bash scripts/gpu_evidence.sh check   OUTDIR   # gpu_tests: pytest tests/gpu (full sizes, gpu.xml);
#                                                 # stage_times_vs_torch: `bench kernels --torch-baseline`
#   bash scripts/gpu_evidence.sh ranks   OUTDIR   # ranks_equal_world_size_1: torchrun NCCL over every GPU,
#                                                 # tests/multigpu/sharded_check.py, GPU arms, scale options
#   bash scripts/gpu_evidence.sh scale   OUTDIR   # step_time_ranks/BACKEND-PRECISION: `bench e2e` under torchrun
#                                                 # (gathers x balances); parity/A_vs_B: parity replays; mpirun_smoke
#   bash scripts/gpu_evidence.sh perf    OUTDIR   # stage_times_vs_torch (`bench kernels`, library defaults),
#                                                 # step_time_ranks/BACKEND-PRECISION (`bench e2e` under torchrun)
#   bash scripts/gpu_evidence.sh chunks  OUTDIR   # the row-local chunks (plan.local_chunks): budget_time_memory/W
#                                                 # and /packed64 (`bench budget`: time, peak memory, 2 and 1 GiB);
#                                                 # ids_every_rank, ids_fused_whole_call: the GPU tests of their ids
#   The CUDA scorer (kernels/cuda_fp8_mqa.cu), its first run in three parts (issue #46, step 1):
#   bash scripts/gpu_evidence.sh cudasmoke OUTDIR # cuda_build: nvcc builds the release and debug libraries
#                                                 # (seconds, device, compiler); cuda_sass: the release SASS's
#                                                 # QGMMA/HGMMA/HMMA/FFMA/FMUL/FADD counts; cuda_smoke/VARIANT:
#                                                 # each variant (H 32/64/128 x q_blocks 1/2 x dense/nostore x
#                                                 # fp8/bf16) in its own process under `timeout 60`, debug build
#                                                 # (sp_kpool.testing.cuda_smoke): one line each in
#                                                 # OUTDIR/cuda_smoke.txt, pass|fail|trap|cuda-error|error|
#                                                 # timeout|crash, a stuck wait's printed barrier appended
#   bash scripts/gpu_evidence.sh cudatests OUTDIR # cuda_tests/FUNCTION: each test function of
#                                                 # tests/gpu/test_cuda_fp8_mqa.py but the smoke in its own
#                                                 # pytest process (no -x, -v as it goes, junit XML), each test
#                                                 # under pytest-timeout (--timeout 120, thread method: a hung
#                                                 # kernel ends the process with every thread's stack), the
#                                                 # process under `timeout 300`; one line each in
#                                                 # OUTDIR/cuda_tests.txt (pytest's summary)
#   bash scripts/gpu_evidence.sh cudabench OUTDIR # only if every line of the smoke record says pass
#                                                 # (SMOKE_RECORD, default OUTDIR/cuda_smoke.txt; with neither,
#                                                 # cudasmoke runs first): cuda_scorer_time: `bench cuda-scorer`
#                                                 # on the slice W, H 32 and 64, FP8 and BF16
#   bash scripts/gpu_evidence.sh cuda    OUTDIR   # cudasmoke, cudatests, cudabench in one call (may not fit)
#   bash scripts/gpu_evidence.sh cudawhole OUTDIR # cuda_scorer_whole_calls: whole calls with SP_KPOOL_CUDA_SCORER=1
#                                                 # against the defaults (`bench budget`, +cuda arms: time, peak
#                                                 # memory, ids)
#   bash scripts/gpu_evidence.sh cudancu OUTDIR   # cuda_scorer_ncu: ncu of DeepGEMM's kernel and the CUDA scorer's
#                                                 # four variants on the slice (FP8, H 32): throughput, occupancy,
#                                                 # stalls
#   bash scripts/gpu_evidence.sh --dry-run PART OUTDIR  # the steps of PART, one a line with its limit and
#                                                 # command; runs and writes nothing (tests/unit/test_gpu_evidence.py)
#
# The next GPU session, issue #46 (one H100/H200; each numbered line one device call, OUT its
# output folder, which keeps whatever a step wrote if the call is cut). First, where the network
# is: bash scripts/gpu_wheels.sh (.gpuwheels/a: deep_gemm and pytest-timeout, < 64 MiB; it goes
# with the tree, or name it in the call's carry where git ignores it). Each call starts with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/gpusite .gpuwheels/a/*.whl && export PYTHONPATH=/tmp/gpusite || exit;
# then:
#   1. bash scripts/gpu_evidence.sh cudasmoke "$OUT"   # step 1: build, SASS, 24 smoke lines
#   2. bash scripts/gpu_evidence.sh cudatests "$OUT"   # step 1: the GPU tests, one process per function
#   3. SMOKE_RECORD=benchmarks/results/RUN/cuda_smoke.txt bash scripts/gpu_evidence.sh cudabench "$OUT"
#      (call 1's OUT/cuda_smoke.txt copied into the tree first; without it the smoke runs again)
#   4. bash scripts/gpu_evidence.sh cudancu "$OUT"     # step 2: ncu of DeepGEMM and the four FP8 H 32 variants
#   5. bash scripts/gpu_evidence.sh cudawhole "$OUT"   # step 2: whole calls with the CUDA scorer
# (3-5: the numbers step 2 decides from; the caches ~/.cache/sp_kpool/cuda and ~/.triton make
# later calls' builds free while the machine stays warm). Step 3's fused path on the CUDA scorer,
# and steps 4-5 (the sparse loss's backward, `shard`), have no code yet: no command here.
set -uo pipefail
dry=0
if [ "${1:-}" = "--dry-run" ]; then
  dry=1
  shift
fi
if [ $# -ne 2 ]; then
  echo "usage: bash scripts/gpu_evidence.sh [--dry-run] PART OUTDIR (the parts: the comments at the top)" >&2
  exit 2
fi
part=$1
out=$2
case $part in
  check | ranks | scale | perf | chunks | cudasmoke | cudatests | cudabench | cuda | cudawhole | cudancu) ;;
  *)
    echo "unknown part: $part (the parts: the comments at the top of scripts/gpu_evidence.sh)" >&2
    exit 2
    ;;
esac
[ "$dry" = 1 ] || mkdir -p "$out"
export PYTHONUNBUFFERED=1
# the scripts and tests/multigpu/sharded_check.py import this checkout's package
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
ngpu=NGPU
[ "$dry" = 1 ] || ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")

# step NAME LIMIT_S COMMAND...: COMMAND under `timeout LIMIT_S` (then SIGKILL 10 s later), its
# stdout and stderr in $out/NAME.log as it goes; appends "NAME: rc=RC ok|failed|timeout (S s)"
# to $out/steps.txt and prints it; returns RC. With --dry-run: prints "NAME: timeout LIMIT_S
# COMMAND" and runs nothing.
step() {
  local name=$1 limit=$2
  shift 2
  if [ "$dry" = 1 ]; then
    echo "$name: timeout $limit $*"
    return 0
  fi
  mkdir -p "$(dirname "$out/$name.log")"
  local t0=$SECONDS rc what
  timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  case $rc in
    0) what=ok ;;
    124 | 137) what="timeout after $limit s" ;;
    *) what=failed ;;
  esac
  echo "$name: rc=$rc $what ($((SECONDS - t0)) s)" | tee -a "$out/steps.txt"
  return $rc
}

# the CUDA scorer: libraries, SASS, each variant's smoke run in its own process
cuda_smoke_part() {
  step cuda_build 300 python3 -m sp_kpool.testing.cuda_smoke --build
  if [ "$dry" = 1 ] || command -v cuobjdump >/dev/null; then
    # the release library's SASS (the build step left it in the cache; a second build is a look-up)
    step cuda_sass 120 bash -c 'cuobjdump --dump-sass "$(python3 -c "from sp_kpool.kernels import cuda_fp8_mqa as m; print(m.build())")"'
    if [ "$dry" = 0 ] && [ -s "$out/cuda_sass.log" ]; then
      local op counts=""
      for op in QGMMA HGMMA HMMA FFMA FMUL FADD; do counts="$counts $op $(grep -c "$op" "$out/cuda_sass.log"),"; done
      echo "SASS:$counts" | tee -a "$out/steps.txt"
      xz -9 "$out/cuda_sass.log"
    fi
  else
    echo "cuda_sass: skipped, no cuobjdump on PATH" | tee -a "$out/steps.txt"
  fi
  local variants v line stuck
  variants=$(python3 -m sp_kpool.testing.cuda_smoke --list) || { echo "cuda_smoke --list failed" >&2; return 1; }
  [ "$dry" = 1 ] || : > "$out/cuda_smoke.txt"
  for v in $variants; do
    step "cuda_smoke/$v" 60 python3 -m sp_kpool.testing.cuda_smoke "$v"
    local rc=$?
    [ "$dry" = 1 ] && continue
    line=$(grep -m 1 "^cuda_smoke $v: " "$out/cuda_smoke/$v.log")
    if [ -z "$line" ]; then
      case $rc in
        124 | 137) line="cuda_smoke $v: timeout (no line within 60 s)" ;;
        *) line="cuda_smoke $v: crash rc=$rc (no line; see cuda_smoke/$v.log)" ;;
      esac
    fi
    stuck=$(grep -m 1 "waited too long" "$out/cuda_smoke/$v.log")
    echo "$line${stuck:+ | $stuck}" >> "$out/cuda_smoke.txt"
  done
  [ "$dry" = 1 ] || { echo "cuda_smoke: $(grep -c ": pass " "$out/cuda_smoke.txt") of $(wc -l < "$out/cuda_smoke.txt") pass"; grep -v ": pass " "$out/cuda_smoke.txt" | cut -c1-400; }
}

# the CUDA scorer's GPU tests: one pytest process per test function, each test under pytest-timeout
cuda_tests_part() {
  local file=tests/gpu/test_cuda_fp8_mqa.py fn limits summary
  limits=(--timeout 120 --timeout-method=thread)
  if [ "$dry" = 0 ] && ! python3 -c "import pytest_timeout" 2>/dev/null; then
    limits=()
    echo "cuda_tests: pytest-timeout is not installed (scripts/gpu_wheels.sh): no per-test limit, only each process's" \
      | tee -a "$out/steps.txt"
  fi
  [ "$dry" = 1 ] || : > "$out/cuda_tests.txt"
  for fn in $(grep -o "^def test_[a-z0-9_]*" "$file" | cut -c5- | grep -v "^test_smoke_of_the_debug_build$"); do
    step "cuda_tests/$fn" 300 python3 -m pytest "$file::$fn" -v -rA -p no:cacheprovider ${limits[@]+"${limits[@]}"} \
      --junitxml="$out/cuda_tests/$fn.xml"
    local rc=$?
    [ "$dry" = 1 ] && continue
    summary=$(grep -E "^=+ .*(passed|failed|error|skipped).* in [0-9.]+s" "$out/cuda_tests/$fn.log" | tail -n 1)
    if grep -q "+ Timeout +" "$out/cuda_tests/$fn.log"; then  # the test that was running when it fired
      summary="$summary pytest-timeout ended the process in $(grep -o "^tests/gpu/[^ ]*" "$out/cuda_tests/$fn.log" | tail -n 1)"
    fi
    echo "cuda_tests $fn: rc=$rc ${summary:-no summary (see cuda_tests/$fn.log)}" | tee -a "$out/cuda_tests.txt"
    grep "^FAILED\|^ERROR" "$out/cuda_tests/$fn.log" | cut -c1-300 | head -n 6
  done
}

# the CUDA scorer's benchmark, only after its smoke runs passed
cuda_bench_part() {
  local record=${SMOKE_RECORD:-$out/cuda_smoke.txt}
  if [ "$dry" = 1 ]; then
    echo "gate: every line of $record says pass (with no record, the cudasmoke steps first)"
  elif [ ! -s "$record" ]; then
    echo "cuda_bench: no smoke record ($record): the smoke steps first" | tee -a "$out/steps.txt"
    cuda_smoke_part
    record=$out/cuda_smoke.txt
  fi
  if [ "$dry" = 0 ] && grep -qv ": pass " "$record"; then
    echo "cuda_bench: skipped, not every smoke run passed ($record): $(grep -v ": pass " "$record" | cut -d: -f1 | cut -c12- | tr '\n' ' ')" \
      | tee -a "$out/steps.txt"
    return 1
  fi
  step cuda_scorer_time 300 python3 -m sp_kpool.bench cuda-scorer --heads 32,64 --cases W --out "$out"
  [ "$dry" = 1 ] || grep "^{" "$out/cuda_scorer_time.log" | cut -c1-1200
}

# show TEXT...: prints TEXT unless --dry-run (a step's summary after it ran)
show() { [ "$dry" = 1 ] || "$@"; }

# the stage times of the GPU backends on the reference slice (and the torch backend's, for the speed-up)
stage_times() {
  step stage_times_vs_torch 200 python3 -m sp_kpool.bench kernels --torch-baseline "$@" --out "$out"
  show cut -c1-700 "$out/stage_times_vs_torch.log"
}

# the step time of every gather and balance option over every GPU of this host (torchrun, NCCL)
step_time_ranks() {
  local arm b p
  for arm in tilelang:bf16 deepgemm:fp8; do
    b=${arm%%:*}; p=${arm##*:}
    step "step_time_ranks/$b-$p" 150 python3 -m torch.distributed.run --standalone --nproc_per_node "$ngpu" \
      -m sp_kpool.bench e2e --backends "$b" --precisions "$p" --seq-lens 131072 --heads 64 --gathers keys,pools \
      --balances none,causal --out "$out"
    show tail -n 6 "$out/step_time_ranks/$b-$p.log"
  done
}

case $part in
  check)
    step gpu_tests 300 env SP_KPOOL_GPU_FULL=1 python3 -m pytest tests/gpu -q -rA --junitxml="$out/gpu.xml"
    show bash -c "tail -n 1 '$out/gpu_tests.log'; grep '^FAILED\|^ERROR' '$out/gpu_tests.log' | cut -c1-400"
    stage_times --budget 0
    ;;
  ranks)
    step ranks_equal_world_size_1 400 python3 -m torch.distributed.run --standalone --nproc_per_node "$ngpu" \
      tests/multigpu/sharded_check.py --arms bf16:torch,bf16:tilelang,bf16-serving:tilelang,bf16:triton,bf16-serving:triton,fp8:deepgemm,fp8:torch \
      --heads 64 --head-dim 128 --dtype bfloat16 --scale
    show tail -n 12 "$out/ranks_equal_world_size_1.log"
    ;;
  scale)
    step_time_ranks
    C=/tmp/kpool_cap/synthetic-call0000.rank000-of-001.safetensors
    step parity/fp8_vs_bf16-serving 60 python3 -m sp_kpool parity --synthetic --tokens 4096 --device cuda \
      --capture-dir /tmp/kpool_cap --a fp8 --b bf16-serving --out "$out/parity/fp8_vs_bf16-serving"
    step parity/fp8_vs_bf16 60 python3 -m sp_kpool parity $C --device cuda --a fp8 --b bf16 --out "$out/parity/fp8_vs_bf16"
    step parity/bf16-serving_vs_bf16 60 python3 -m sp_kpool parity $C --device cuda --a bf16-serving --b bf16 \
      --out "$out/parity/bf16-serving_vs_bf16"
    step parity/fp8_gpu_vs_torch 60 python3 -m sp_kpool parity $C --device cuda --a fp8 --b fp8:torch \
      --out "$out/parity/fp8_gpu_vs_torch"
    show bash -c "cd '$out' && tail -n 30 parity/*.log && tar czf parity.tgz parity && rm -rf parity"
    if [ "$dry" = 1 ] || command -v mpirun >/dev/null; then
      step mpirun_smoke 120 mpirun -np "$ngpu" --allow-run-as-root --oversubscribe python3 -m mpi4py scripts/mpirun_smoke.py
      show tail -n 8 "$out/mpirun_smoke.log"
    fi
    ;;
  chunks)
    step budget_time_memory/W 170 python3 -m sp_kpool.bench budget --cases W --heads 32,64 --arms fp8:deepgemm,bf16:triton \
      --budgets 2048,1024 --out "$out/budget_time_memory/W"
    step budget_time_memory/packed64 60 python3 -m sp_kpool.bench budget --cases packed64 --heads 32,64 \
      --arms fp8:deepgemm,bf16:triton --budgets 2048 --out "$out/budget_time_memory/packed64"
    show bash -c "grep -h '^{' '$out'/budget_time_memory/*.log | cut -c1-420"
    step ids_every_rank 150 python3 -m pytest tests/gpu/test_ranks.py -q -k "deepgemm or triton" --junitxml="$out/ranks.xml"
    step ids_fused_whole_call 150 python3 -m pytest tests/gpu/test_fused_fp8.py -q -k "whole_call and not 8192 and not 128" \
      --junitxml="$out/fused_whole_call.xml"
    show tail -n 2 "$out/ids_every_rank.log" "$out/ids_fused_whole_call.log"
    ;;
  cudasmoke) cuda_smoke_part ;;
  cudatests) cuda_tests_part ;;
  cudabench) cuda_bench_part ;;
  cuda)
    cuda_smoke_part
    cuda_tests_part
    cuda_bench_part
    ;;
  cudancu)
    step cuda_scorer_ncu 540 ncu --clock-control none --target-processes all -k regex:fp8_mqa --section SpeedOfLight \
      --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
      -o "$out/cuda_scorer_ncu" python3 -m sp_kpool.bench cuda-scorer --profile --cases W --heads 32 --precisions fp8
    [ "$dry" = 1 ] && exit 0
    tail -n 5 "$out/cuda_scorer_ncu.log"
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
    step cuda_scorer_whole_calls 400 python3 -m sp_kpool.bench budget --cases W,packed64 --heads 32,64 --budgets 2048 \
      --arms fp8:deepgemm,fp8:deepgemm+cuda,bf16:triton,bf16:triton+cuda --out "$out"
    show bash -c "grep '^{' '$out/cuda_scorer_whole_calls.log' | cut -c1-420"
    ;;
  perf)
    stage_times
    step_time_ranks
    ;;
esac
