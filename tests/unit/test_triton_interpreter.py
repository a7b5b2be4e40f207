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


@pytest.mark.parametrize("order", ["ascending", "score"])
def test_select_pools_into_out_rows(order):
    # out=: the rows are written whole (-1 past min(k, width)), nothing else is touched,
    # and the ids equal the plain call's
    g = torch.Generator().manual_seed(3)
    s = torch.randn(4, 6, generator=g)
    s[1, 2] = -math.inf  # an invisible cell
    for k in (3, 8):  # fewer and more than the 6 columns
        big = torch.full((6, k + 2), 777, dtype=torch.int32)
        got = select_pools(s, None, k, 100, order=order, out=big[1:5, 1 : 1 + k])
        ref = select_pools(s, None, k, 100, order=order)
        assert got.data_ptr() == big[1, 1].data_ptr()
        assert torch.equal(big[1:5, 1 : 1 + ref.shape[1]], ref.int())
        assert bool((big[1:5, 1 + ref.shape[1] : 1 + k] == -1).all())
        assert bool((big[0] == 777).all() and (big[5] == 777).all() and (big[:, 0] == 777).all())
        assert bool((big[:, 1 + k :] == 777).all())
    with pytest.raises(ValueError, match=r"out: expected an int32 tensor of shape \(4, 3\)"):
        select_pools(s, None, 3, 100, order=order, out=torch.empty((4, 2), dtype=torch.int32))
