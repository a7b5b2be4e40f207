# source me: installs wheel set a into /tmp/gpusite (once per machine) and sets PYTHONPATH
if [ ! -d /tmp/gpusite/deep_gemm ]; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/gpusite .gpuwheels/a/*.whl 2>&1 | tail -2
  tar xzf .gpuwheels/a/lmdeploy_kernels.tgz -C /tmp/gpusite
fi
export PYTHONPATH=/tmp/gpusite:$PWD PYTHONUNBUFFERED=1
env_txt() {
  date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton, deep_gemm; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, deep_gemm.__version__)" 2>&1
  git log -1 --format=%H 2>/dev/null; git diff --stat 2>/dev/null | tail -1
}
