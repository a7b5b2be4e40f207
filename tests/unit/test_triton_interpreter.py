"""Runs ``triton_interp_cases.py`` (the Triton selector and expansion kernels, bit for bit
against the torch rules) in a child pytest with ``TRITON_INTERPRET=1``: Triton reads the
variable when it is imported, so it must not be set in this process, whose tests may launch
GPU processes elsewhere."""

import math
import os
import subprocess
import sys

import pytest
import torch

from sp_kpool.selection import select_pools, topk_pools

CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_interp_cases.py")


def test_triton_kernels_in_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--rootdir", str(tmp_path), CASES]
    res = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, tail
    assert " passed" in res.stdout and " failed" not in res.stdout and "skipped" not in res.stdout, tail


def test_nan_scores_are_never_selected_on_cpu():
    s = torch.tensor([[0.5, math.nan, 1.0, 2.0, -math.nan, 0.1]])
    vis = torch.ones_like(s, dtype=torch.bool)
    assert select_pools(s, vis, 3, 0, order="ascending").tolist() == [[0, 2, 3]]
    assert select_pools(s, None, 3, 0, order="ascending").tolist() == [[0, 2, 3]]
    p, ok = topk_pools(s, vis, 6, 10)
    assert p.tolist() == [[13, 12, 10, 15, -1, -1]] and ok.sum() == 4
