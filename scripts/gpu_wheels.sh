#!/usr/bin/env bash
# Fetch, on a machine with network access, the wheels that the GPU backends need on a GPU
# host that has none (CPython 3.12, Linux x86_64, manylinux). They go into two folders,
# each small enough (< 64 MiB) to be copied to the host on its own:
#
#   OUT/a  z3-solver, apache-tvm-ffi, torch-c-dlpack-ext, tokenspeed-deepgemm (deep_gemm),
#          pytest-timeout (the per-test limit of `scripts/gpu_evidence.sh cudatests`),
#          and lmdeploy_kernels.tgz (see below)
#   OUT/b  tilelang
#
# lmdeploy_kernels.tgz is not an lmdeploy install. It is a cut-down lmdeploy 0.18.0 tree
# with only lmdeploy/version.py and the three CUDA kernel modules the selector checks use
# (lmdeploy/pytorch/kernels/cuda/{sparse_index_topk,ds_index,utils}.py), with near-empty
# package __init__ files, so that it imports without the serving engine and its
# dependencies. Where a package index is reachable, use `pip install lmdeploy` instead.
#
# Usage (from any working directory; OUT defaults to .gpuwheels in the repository root,
# a relative OUT is taken from the current directory):
#   bash scripts/gpu_wheels.sh [OUT]
#
# Then, on the GPU host (torch 2.11 / CUDA 13 already installed), with TARGET a folder of
# your choice, for example /tmp/gpusite:
#   python3 -m pip install --no-index --no-deps --target TARGET OUT/a/*.whl OUT/b/*.whl
#   tar xzf OUT/a/lmdeploy_kernels.tgz -C TARGET
#   export PYTHONPATH=TARGET:$PWD      # $PWD: the repository root
#   python3 -m sp_kpool info           # lists which backends load
# The two folders may be installed in separate steps into the same TARGET.
#
# Versions: checked with torch 2.11.0+cu130 on an NVIDIA H200 (see
# benchmarks/results/h200-cu130-torch2.11/README.md and docs/measurements.md).
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$repo_root/.gpuwheels}
mkdir -p "$out/a" "$out/b"
out=$(cd "$out" && pwd)  # absolute, so that an OUT given relative to the caller's cwd works
cd "$repo_root"
limit_mib=64

# Keep the default download folder out of `git status` (only where .git is a directory;
# in a git worktree it is a file and nothing is written).
if [ "$out" = "$repo_root/.gpuwheels" ] && [ -d .git/info ]; then
  grep -qxF "/.gpuwheels/" .git/info/exclude 2>/dev/null || echo "/.gpuwheels/" >> .git/info/exclude
fi

platform_args=(
  --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64
)

download() {  # download DEST SPEC...
  local dest=$1
  shift
  python3 -m pip download --quiet --no-deps "${platform_args[@]}" --dest "$dest" "$@"
}

download "$out/a" \
  "z3-solver==4.15.4.0" \
  "apache-tvm-ffi==0.1.12" \
  "torch-c-dlpack-ext==0.1.5" \
  "tokenspeed-deepgemm==2.5.0.post20260629" \
  "pytest-timeout==2.4.0"
download "$out/b" "tilelang==0.1.15"

if [ ! -f "$out/a/lmdeploy_kernels.tgz" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  download "$work" "lmdeploy==0.18.0"
  wheel=$(find "$work" -maxdepth 1 -name 'lmdeploy-*.whl' | head -n 1)
  python3 -m zipfile -e "$wheel" "$work/wheel"
  kernels=lmdeploy/pytorch/kernels/cuda
  mkdir -p "$work/tree/$kernels"
  cp "$work/wheel/lmdeploy/version.py" "$work/tree/lmdeploy/"
  echo "from .version import __version__" > "$work/tree/lmdeploy/__init__.py"
  : > "$work/tree/lmdeploy/pytorch/__init__.py"
  : > "$work/tree/lmdeploy/pytorch/kernels/__init__.py"
  : > "$work/tree/$kernels/__init__.py"
  for module in sparse_index_topk ds_index utils; do
    cp "$work/wheel/$kernels/$module.py" "$work/tree/$kernels/"
  done
  tar czf "$out/a/lmdeploy_kernels.tgz" -C "$work/tree" lmdeploy
fi

status=0
for folder in "$out/a" "$out/b"; do
  size_kib=$(du -sk "$folder" | cut -f1)
  echo "$folder: $((size_kib / 1024)) MiB"
  if [ "$size_kib" -ge $((limit_mib * 1024)) ]; then
    echo "error: $folder is not under $limit_mib MiB" >&2
    status=1
  fi
done
exit "$status"
