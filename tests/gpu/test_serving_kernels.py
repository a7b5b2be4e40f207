"""Triton serving kernels (fp8 pools with scales, bf16-serving pools, fp8 queries, pools and
queries in one launch) bitwise equal to the torch serving implementation on the same GPU
(gpu_check section ``serving-kernels``); the model-pooling kernel (``bf16``) bitwise equal
to the torch ops of ``pooling.compress_pools_bf16`` on the same GPU."""

import pytest
import torch

from sp_kpool import serving
from sp_kpool.pooling import compress_pools_bf16, pool_table

pytestmark = [pytest.mark.requires("triton"), pytest.mark.xdist_group("gpu")]

POOL_CASES = [(4099, 128, 4), (1000, 64, 1), (777, 128, 16), (4096, 128, 4),
              pytest.param(131072, 128, 4, marks=pytest.mark.slow)]  # fmt: skip
# D 128 runs the register kernel, other D (and generic=True) the generic one
QUERY_CASES = [(37, 16, 64, False), (37, 16, 128, False), (4096, 64, 128, False), (1000, 32, 128, False),
               (4096, 64, 128, True)]  # fmt: skip
ZERO_ROWS = [(3, 5), (1000, 0), (0, 777)]
ONE_LAUNCH_CASES = [(4099, 32, 128, 4, 3, 5), (1000, 64, 128, 16, 0, 0), (4096, 64, 128, 4, 1000, 777),
                    (777, 16, 64, 4, 2, 2)]  # fmt: skip


def _u8(x):
    return x.view(torch.uint8)


def _pool_inputs(S, D, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(S, D, generator=g, device="cuda").bfloat16()
    gates = (torch.randn(S, D, generator=g, device="cuda") * 3).bfloat16()
    ape = torch.randn(K, D, generator=g, device="cuda").bfloat16()
    return g, k, gates, ape, pool_table(torch.tensor([0, S // 3, S]), K)[0].cuda()


@pytest.mark.parametrize("S,D,K", POOL_CASES)
def test_fp8_pools(S, D, K):
    from sp_kpool.kernels.triton_serving import pools_serving

    _, k, gates, ape, starts = _pool_inputs(S, D, K, S)
    k8, ks = pools_serving(k, gates, ape, starts, fp8=True)
    r8, rs = serving.prepare_pools_fp8(k, gates, ape, starts)
    nbad, nscales = int((_u8(k8) != _u8(r8)).sum()), int((ks != rs).sum())
    assert torch.equal(_u8(k8), _u8(r8)) and torch.equal(ks, rs), (
        f"pools={starts.numel()} differing_values={nbad} differing_scales={nscales}")  # fmt: skip


@pytest.mark.parametrize("S,D,K", POOL_CASES)
def test_bf16_serving_pools(S, D, K):
    from sp_kpool.kernels.triton_serving import pools_serving

    _, k, gates, ape, starts = _pool_inputs(S, D, K, S)
    pb = pools_serving(k, gates, ape, starts, fp8=False)
    rb = serving.prepare_pools_bf16_serving(k, gates, ape, starts)
    differing = int((pb.view(torch.int16) != rb.view(torch.int16)).sum())
    assert torch.equal(pb.view(torch.int16), rb.view(torch.int16)), f"differing={differing}"


def _same_bf16(a, b):
    """Equal bit for bit, NaN payloads aside (torch writes 0x7FC0, the GPU's conversion 0x7FFF)."""
    a16, b16 = a.view(torch.int16), b.view(torch.int16)
    return bool(((a16 == b16) | (a.isnan() & b.isnan())).all()), int(((a16 != b16) & ~(a.isnan() & b.isnan())).sum())


@pytest.mark.parametrize("S,D,K", POOL_CASES)
@pytest.mark.parametrize("gates_dtype", [torch.bfloat16, torch.float32])
def test_model_pools(S, D, K, gates_dtype):
    from sp_kpool.kernels.triton_serving import pools_model

    _, k, gates, ape, starts = _pool_inputs(S, D, K, S + 3)
    gates = gates.to(gates_dtype)
    if gates_dtype == torch.float32:  # values BF16 cannot hold
        gates = gates + torch.rand(gates.shape, device="cuda") * 1e-3
    ok, bad = _same_bf16(pools_model(k, gates, ape, starts), compress_pools_bf16(k, gates, ape, starts))
    assert ok, f"pools={starts.numel()} differing={bad}"


def test_model_pools_hard_cases():
    # NaN and infinite gates, -inf slots everywhere, huge and equal gates, signed zero keys;
    # and pools whose BF16 probabilities differ between exp / sum and exp * (1 / sum)
    from sp_kpool.kernels.triton_serving import pools_model

    _, k, gates, ape, starts = _pool_inputs(4096, 128, 4, 11)
    gates = gates.float()
    gates[0:4, 0] = float("nan")
    gates[5, 1] = float("nan")
    gates[8:12, 2] = float("-inf")
    gates[13, 3] = float("inf")
    gates[16:20, 4] = -1e30
    gates[20:24, 5] = 2.5
    gates[24:28] = 88.0
    k[28:32] = 0.0
    k[32:36] = -0.0
    g = torch.Generator(device="cuda").manual_seed(0)
    s = torch.randn(1 << 21, 4, generator=g, device="cuda") * 3
    e = torch.exp(s - s.max(1, keepdim=True).values)
    den = ((e[:, 0] + e[:, 1]) + e[:, 2]) + e[:, 3]
    a, b = (e / den[:, None]).bfloat16(), (e * (1 / den[:, None])).bfloat16()
    picked = s[(a.view(torch.int16) != b.view(torch.int16)).any(1)][:64]
    assert picked.shape[0] >= 8
    ok, bad = _same_bf16(pools_model(k, gates, ape, starts), compress_pools_bf16(k, gates, ape, starts))
    assert ok, f"differing={bad}"
    # the picked logits in every channel (ape zero: the logits are the gates exactly)
    n, zero = picked.shape[0], torch.zeros_like(ape)
    crafted = picked.reshape(-1, 1).expand(-1, 128).contiguous()
    starts = torch.arange(0, 4 * n, 4, device="cuda")
    ok, bad = _same_bf16(pools_model(k[: 4 * n], crafted, zero, starts), compress_pools_bf16(k[: 4 * n], crafted, zero, starts))
    assert ok, f"crafted pools: differing={bad}"


def _queries(S, H, D):
    g = torch.Generator(device="cuda").manual_seed(H)
    q = torch.randn(S, H, D, generator=g, device="cuda").bfloat16()
    w = torch.randn(S, H, generator=g, device="cuda").bfloat16()
    if S == 37:  # wide dynamic range: rounding in the butterflies, tiny and huge scales
        q = (q.float() * torch.exp2(torch.randint(-30, 30, (S, H, 1), generator=g, device="cuda").float())).bfloat16()
    return q, w


@pytest.mark.parametrize("S,H,D,generic", QUERY_CASES)
def test_fp8_queries(S, H, D, generic):
    from sp_kpool.kernels.triton_serving import queries_fp8

    q, w = _queries(S, H, D)
    q8, wq = queries_fp8(q, w, generic=generic)
    r8, rw = serving.prepare_queries_fp8(q, w)
    assert torch.equal(_u8(q8), _u8(r8)) and torch.equal(wq, rw), (
        f"differing_values={int((_u8(q8) != _u8(r8)).sum())} differing_weights={int((wq != rw).sum())}")  # fmt: skip


@pytest.mark.parametrize("before,after", ZERO_ROWS)
@pytest.mark.parametrize("S,H,D,generic", QUERY_CASES)
def test_fp8_queries_zero_rows(S, H, D, generic, before, after):
    # zero rows written around the prepared ones (the driver's chunk grid): before / after
    # rows that are whole programs of zeros, and ones that share a program
    from sp_kpool.kernels.triton_serving import queries_fp8

    q, w = _queries(S, H, D)
    r8, rw = serving.prepare_queries_fp8(q, w)
    p8, pw = queries_fp8(q, w, generic=generic, before=before, after=after)
    z8, zw = serving.prepare_queries_fp8(torch.zeros_like(q[:1]), torch.zeros_like(w[:1]))
    assert p8.shape[0] == pw.shape[0] == before + S + after
    assert torch.equal(_u8(p8[before : before + S]), _u8(r8))
    assert torch.equal(pw[before : before + S], rw)
    assert bool((_u8(p8[:before]) == _u8(z8)).all()) and bool((_u8(p8[before + S :]) == _u8(z8)).all())
    assert bool((pw[:before] == zw).all()) and bool((pw[before + S :] == zw).all())
    assert int(_u8(z8).max()) == 0 and int(zw.abs().max()) == 0


@pytest.mark.parametrize("S,H,D,K,before,after", ONE_LAUNCH_CASES)
def test_prepare_fp8_one_launch(S, H, D, K, before, after):
    # pools and queries in one launch (the deepgemm backend's driver path; D 64 takes the
    # two kernels): the same bits as the torch implementation, zero rows around the queries
    from sp_kpool.kernels.triton_serving import prepare_fp8

    g, k, gates, ape, starts = _pool_inputs(S, D, K, S + H)
    q = torch.randn(S, H, D, generator=g, device="cuda").bfloat16()
    w = torch.randn(S, H, generator=g, device="cuda").bfloat16()
    (k8, ks), (q8, wq) = prepare_fp8(q, w, k, gates, ape, starts, before=before, after=after)
    r8, rs = serving.prepare_pools_fp8(k, gates, ape, starts)
    z = torch.zeros(before + S + after, H, D, dtype=q.dtype, device="cuda")
    zw = torch.zeros(before + S + after, H, dtype=w.dtype, device="cuda")
    z[before : before + S], zw[before : before + S] = q, w
    p8, pw = serving.prepare_queries_fp8(z, zw)
    info = (f"one_launch={D == 128} pools={starts.numel()} differing_pool_values={int((_u8(k8) != _u8(r8)).sum())} "
            f"differing_query_values={int((_u8(q8) != _u8(p8)).sum())}")  # fmt: skip
    assert torch.equal(_u8(k8), _u8(r8)) and torch.equal(ks, rs), info
    assert torch.equal(_u8(q8), _u8(p8)) and torch.equal(wq, pw), info


def _mixed_extend(n, seed):
    """A mask of pools in extend order: runs of both orders and isolated pools, mixed inside
    every block of 16 pools."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    mask = torch.rand(n, generator=g, device="cuda") < 0.5
    mask[: n // 3] = True  # a prompt-like prefix
    return mask


@pytest.mark.parametrize("S,D,K", POOL_CASES)
@pytest.mark.parametrize("fp8", [True, False])
def test_scheduled_pools(S, D, K, fp8):
    # the compression order chosen per pool (extend / decode): bitwise equal to torch
    from sp_kpool.kernels.triton_serving import pools_serving

    _, k, gates, ape, starts = _pool_inputs(S, D, K, S + 7)
    ext = _mixed_extend(starts.numel(), S)
    got = pools_serving(k, gates, ape, starts, fp8=fp8, extend=ext)
    if fp8:
        r8, rs = serving.prepare_pools_fp8(k, gates, ape, starts, ext)
        assert torch.equal(_u8(got[0]), _u8(r8)) and torch.equal(got[1], rs), (
            f"pools={starts.numel()} differing_values={int((_u8(got[0]) != _u8(r8)).sum())}")  # fmt: skip
    else:
        rb = serving.prepare_pools_bf16_serving(k, gates, ape, starts, ext)
        assert torch.equal(got.view(torch.int16), rb.view(torch.int16)), (
            f"differing={int((got.view(torch.int16) != rb.view(torch.int16)).sum())}")  # fmt: skip
    # the orders do differ on these inputs (else the check above could not fail); with one
    # slot per pool they cannot (both give k * 1 / 1)
    if K > 1:
        ext_all = serving.compress_pools_extend(k, gates, ape, starts)
        dec_all = serving.compress_pools_decode(k, gates, ape, starts)
        assert bool((ext_all != dec_all).any())


@pytest.mark.parametrize("S,H,D,K,before,after", ONE_LAUNCH_CASES)
def test_prepare_fp8_one_launch_scheduled(S, H, D, K, before, after):
    from sp_kpool.kernels.triton_serving import prepare_fp8

    g, k, gates, ape, starts = _pool_inputs(S, D, K, S + H + 1)
    q = torch.randn(S, H, D, generator=g, device="cuda").bfloat16()
    w = torch.randn(S, H, generator=g, device="cuda").float()  # the FP32 head gate
    ext = _mixed_extend(starts.numel(), S + 1)
    (k8, ks), (q8, wq) = prepare_fp8(q, w, k, gates, ape, starts, before=before, after=after, extend=ext)
    r8, rs = serving.prepare_pools_fp8(k, gates, ape, starts, ext)
    assert torch.equal(_u8(k8), _u8(r8)) and torch.equal(ks, rs), f"differing={int((_u8(k8) != _u8(r8)).sum())}"
    z = torch.zeros(before + S + after, H, D, dtype=q.dtype, device="cuda")
    zw = torch.zeros(before + S + after, H, dtype=w.dtype, device="cuda")
    z[before : before + S], zw[before : before + S] = q, w
    p8, pw = serving.prepare_queries_fp8(z, zw)
    assert torch.equal(_u8(q8), _u8(p8)) and torch.equal(wq, pw)
