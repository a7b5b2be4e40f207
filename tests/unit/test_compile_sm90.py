"""The Triton scorer kernels compile for Hopper (sm_90) on a CPU, to ``wgmma`` and no
``mma.sync``, at one launch shape of each code path, and the selector kernels at their
default launches (``sp_kpool.testing.compile_sm90``, in a
child process: Triton must not run under the interpreter there). CI has no GPU: this is the
part of a kernel change that CI can check besides the interpreter's results."""

import json
import os
import subprocess
import sys

import pytest


def test_scorer_kernels_compile_to_wgmma(tmp_path):
    pytest.importorskip("triton")
    from sp_kpool.testing.compile_sm90 import QUICK, SELECTOR_CASES, uses_wgmma_only

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # a fresh cache: every case compiles here
    cmd = [sys.executable, "-m", "sp_kpool.testing.compile_sm90", "--quick"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    scorers, selectors = [r for r in rows if "H" in r], [r for r in rows if "selector" in r]
    assert [(r["H"], r["dtype"], r["mode"]) for r in scorers] == [tuple(c) for c in QUICK]
    assert all(r["wgmma_only"] for r in scorers), scorers
    assert [(r["selector"], r["W"], r["k"]) for r in selectors] == [
        (kind, W, k) for W, k in SELECTOR_CASES for kind in ("select", "short")]
    assert all(r["ptx_lines"] > 100 for r in selectors), selectors
    # the check itself: a fallback to mma.sync (or no wgmma) is caught
    assert uses_wgmma_only("wgmma.mma_async.sync.aligned.m64n128k16")
    assert not uses_wgmma_only("wgmma.mma_async.sync.aligned.m64n128k16\nmma.sync.aligned.m16n8k16")
    assert not uses_wgmma_only("mma.sync.aligned.m16n8k16")
