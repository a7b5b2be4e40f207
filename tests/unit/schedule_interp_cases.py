"""The serving Triton kernels with a compression schedule (``extend=``), run by Triton's CPU
interpreter, against the torch serving functions with the same mask, bit for bit.

Not collected directly (the name does not start with ``test_``): ``test_schedule.py`` runs
this file in a child pytest with ``TRITON_INTERPRET=1``. The pools mix random ones with
pools crafted (``test_schedule.craft_pools``) so that the two orders store different BF16 /
FP8 values, and the masks mix both orders inside one kernel block (16 pools).
"""

import os
import sys

import numpy as np
import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run this file with TRITON_INTERPRET=1 (tests/unit/test_schedule.py does)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_schedule import K, craft_pools  # noqa: E402

from sp_kpool import serving  # noqa: E402
from sp_kpool.testing.triton_interp import interpreted_module  # noqa: E402

ts = interpreted_module("sp_kpool.kernels.triton_serving")

#: 36 pools (blocks of 16: 16, 16, 4); the crafted ones at these pool ids
CRAFTED = [1, 2, 5, 14, 17, 18, 30, 33]
NPOOLS = 36


def problem(d, seed):
    """``(k, gates, ape, pool_tok_start)``: 36 pools of 4 tokens, plus 3 tokens of no pool at
    the front (pool starts off multiples of K), FP32; the crafted pools at ``CRAFTED``."""
    kc, gc, ape = craft_pools(seed, d, len(CRAFTED), fp8=True)
    rng = np.random.default_rng(seed + 1)
    S = 3 + NPOOLS * K
    k = rng.standard_normal((S, d)).astype(np.float32)
    g = rng.standard_normal((S, d)).astype(np.float32)
    for i, p in enumerate(CRAFTED):
        k[3 + p * K : 3 + (p + 1) * K] = kc[i * K : (i + 1) * K]
        g[3 + p * K : 3 + (p + 1) * K] = gc[i * K : (i + 1) * K]
    starts = torch.arange(3, S, K, dtype=torch.int64)
    return torch.from_numpy(k), torch.from_numpy(g), torch.from_numpy(ape), starts


def masks():
    rng = np.random.default_rng(5)
    mixed = torch.from_numpy(rng.random(NPOOLS) < 0.5)
    mixed[CRAFTED] = torch.tensor([True, False, True, False, False, True, True, False])
    return {"mixed": mixed, "flipped": ~mixed, "all": torch.ones(NPOOLS, dtype=torch.bool),
            "prefix": torch.arange(NPOOLS) < 17}  # fmt: skip


def u(t):
    return t.contiguous().view({torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8,
                                torch.float32: torch.int32}[t.dtype])  # fmt: skip


@pytest.mark.parametrize("fp8", [False, True])
def test_pools_serving_with_extend_equals_torch(fp8):
    k, g, ape, starts = problem(64, 11)
    ms = masks()

    def torch_ref(ext):
        if fp8:
            return serving.prepare_pools_fp8(k, g, ape, starts, ext)
        return (serving.prepare_pools_bf16_serving(k, g, ape, starts, ext),)

    def kernel(ext):
        out = ts.pools_serving(k, g, ape, starts, fp8=fp8, extend=ext)
        return out if fp8 else (out,)

    base = torch_ref(None)
    got = kernel(None)
    assert all(torch.equal(u(a), u(b)) for a, b in zip(got, base))  # extend=None: today's result
    for name, m in ms.items():
        want = torch_ref(m)
        got = kernel(m)
        for a, b in zip(got, want):
            assert torch.equal(u(a), u(b)), name
        # the schedule is visible: every crafted pool marked extend differs from decode
        diff = (u(want[0]) != u(base[0])).any(1)
        if fp8:
            diff |= u(want[1]) != u(base[1])
        assert diff[CRAFTED].tolist() == m[CRAFTED].tolist(), name


def test_prepare_fp8_with_extend_equals_torch():
    k, g, ape, starts = problem(128, 12)
    rng = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 128, generator=rng)
    w = torch.randn(3, 2, generator=rng)
    q8_ref, w_ref = serving.prepare_queries_fp8(q, w)
    base = serving.prepare_pools_fp8(k, g, ape, starts)
    for name, m in {"none": None, **masks()}.items():
        (k8, ks), (q8, wq) = ts.prepare_fp8(q, w, k, g, ape, starts, before=1, after=2, extend=m)
        w8, wks = serving.prepare_pools_fp8(k, g, ape, starts, m)
        assert torch.equal(u(k8), u(w8)) and torch.equal(u(ks), u(wks)), name
        assert torch.equal(u(q8[1:4]), u(q8_ref)) and torch.equal(u(wq[1:4]), u(w_ref)), name
        assert not u(q8[0]).any() and not u(q8[4:]).any() and not u(wq[0]).any() and not u(wq[4:]).any()
        if m is not None:
            diff = (u(w8) != u(base[0])).any(1) | (u(wks) != u(base[1]))
            assert diff[CRAFTED].tolist() == m[CRAFTED].tolist(), name


def test_extend_argument_is_checked():
    k, g, ape, starts = problem(64, 11)
    with pytest.raises(ValueError, match="extend"):
        ts.pools_serving(k, g, ape, starts, fp8=False, extend=torch.ones(NPOOLS - 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="extend"):
        ts.pools_serving(k, g, ape, starts, fp8=True, extend=torch.ones(NPOOLS, dtype=torch.uint8))
