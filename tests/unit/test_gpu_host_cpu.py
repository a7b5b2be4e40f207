"""The host code of the GPU backends (``deepgemm``, ``tilelang``, ``triton``) on CPU: runs
``gpu_host_cpu_cases.py`` (the backends with :mod:`sp_kpool.testing.standins` installed,
against the torch backend, bit for bit) in a child pytest with ``TRITON_INTERPRET=1``:
Triton reads the variable when it is imported, so it must not be set in this process."""

import os
import subprocess
import sys

import pytest

CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_host_cpu_cases.py")


def test_gpu_backends_host_code_on_cpu(tmp_path):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("SP_KPOOL_MQA_LAYOUT", None)
    env.pop("SP_KPOOL_MAX_LOGITS_BYTES", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--rootdir", str(tmp_path), CASES]
    res = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    tail = (res.stdout + res.stderr)[-6000:]
    assert res.returncode == 0, tail
    assert " passed" in res.stdout and " failed" not in res.stdout and "skipped" not in res.stdout, tail
