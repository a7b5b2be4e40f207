set -u
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/gpusite .gpuwheels/a/*.whl 2>&1 | tail -2
tar xzf .gpuwheels/a/lmdeploy_kernels.tgz -C /tmp/gpusite
du -sh /tmp/gpusite
