"""The ``triton`` backend (BF16 modes; the DeepGEMM-order Triton scorer on BF16 inputs): rows
where it differs from the torch reference and from ``tilelang`` are near-ties only (float64
scores), repeated calls and a small logits budget are bitwise identical, the fused mode of
the same kernel selects the same ids, the compiled scorer uses wgmma and no ``mma.sync``, and
the logits storage stays within the budget (every layout on 2 and 4 ranks: ``test_ranks``)."""

import dataclasses

import pytest
import torch

from sp_kpool.backends import BACKENDS
from sp_kpool.backends.base import fold_bf16_weights
from sp_kpool.pooling import pool_table
from sp_kpool.testing.gpu_checks import bf16_row_scores, ids_of, near_tie_rows
from sp_kpool.testing.problems import rank_slice_problem

pytestmark = [pytest.mark.requires("triton"), pytest.mark.xdist_group("gpu")]

CASES = [(8192 + 3, 4, 3, [5000, 7, 3188]), (16384, 4, 3, None),
         pytest.param(65536, 4, 3, None, marks=pytest.mark.slow)]  # fmt: skip
HEADS = (32, 64, 128)


def _run(cache, H, total, ws, rank, lengths, precision="bf16"):
    key = ("triton", H, total, ws, rank, tuple(lengths or ()), precision)
    if key not in cache:
        p = rank_slice_problem(total, ws, rank, heads=H, head_dim=128, topk=2048, lengths=lengths, seed=H,
                               precision=precision)  # fmt: skip
        cache[key] = p, ids_of("triton", p)
    return cache[key]


@pytest.mark.parametrize("total,ws,rank,lengths", CASES)
@pytest.mark.parametrize("H", HEADS)
@pytest.mark.parametrize("other", ["torch", pytest.param("tilelang", marks=pytest.mark.requires("tilelang"))])
def test_differing_rows_are_near_ties(cache, H, total, ws, rank, lengths, other):
    p, a = _run(cache, H, total, ws, rank, lengths)
    b = ids_of(other, p)
    pooled = BACKENDS["torch"].pools(p, pool_table(p.seq.real_cu_seq_lens, 4)[0].cuda())
    ndiff, bad = near_tie_rows(p, a, b, bf16_row_scores(p, pooled))
    assert not bad, f"rows={a.shape[0]} differing_rows={ndiff} beyond_near_tie={bad[:5]}"


@pytest.mark.parametrize("total,ws,rank,lengths", CASES[:2])
@pytest.mark.parametrize("H", HEADS)
def test_repeat_and_small_budget_bitwise(cache, H, total, ws, rank, lengths):
    p, a = _run(cache, H, total, ws, rank, lengths)
    for _ in range(3):
        assert torch.equal(a, ids_of("triton", p))
    small = dataclasses.replace(p, config=p.config.replace(max_logits_bytes=3 * 2**20 + 12345))
    assert torch.equal(a, ids_of("triton", small))


@pytest.mark.parametrize("H", HEADS)
def test_bf16_serving_pools_are_serving_pools(cache, H):
    # bf16-serving: the same scorer on serving's pools; differing rows near-ties of their scores
    p, a = _run(cache, H, 8192 + 3, 4, 3, [5000, 7, 3188], precision="bf16-serving")
    b = ids_of("torch", p)
    pooled = BACKENDS["torch"].pools(p, pool_table(p.seq.real_cu_seq_lens, 4)[0].cuda())
    ndiff, bad = near_tie_rows(p, a, b, bf16_row_scores(p, pooled))
    assert not bad, f"differing_rows={ndiff} beyond_near_tie={bad[:5]}"


@pytest.mark.parametrize("H", HEADS)
def test_fused_selection_equals_dense(H):
    # the fused mode of the same kernel on BF16 inputs: the dense logits plus the exact Top-K
    from sp_kpool.kernels import triton_fp8_fused as ff
    from sp_kpool.selectors import select_pools

    g = torch.Generator(device="cuda").manual_seed(H)
    C, P = 301, 3001
    q = torch.randn(C, H, 128, generator=g, device="cuda").bfloat16()
    w = torch.randn(C, H, generator=g, device="cuda") * 0.05
    keys = torch.randn(P, 128, generator=g, device="cuda").bfloat16()
    starts = torch.randint(0, P // 2, (C,), generator=g, device="cuda", dtype=torch.int32)
    ends = torch.clamp(starts + torch.randint(0, P, (C,), generator=g, device="cuda", dtype=torch.int32), max=P)
    for k in (512, 7):
        dense = ff.score_select(q, w, keys, None, starts, ends, k, dense=True)
        want = select_pools(dense, None, k, 0, ends, order="ascending", starts=starts)
        got, emitted = ff.score_select(q, w, keys, None, starts, ends, k)
        assert torch.equal(got, want.int()), k
        assert int(emitted.min()) >= 0
    bq = ff._shape("t", H, 128, 1, None, None)[1]
    for dense in (True, False):  # the dense and the fused kernel
        ptx = ff.compiled[(H, bq, ff.BLOCK_P, dense, True, torch.bfloat16)].asm["ptx"]
        assert "wgmma" in ptx and "mma.sync" not in ptx.replace("wgmma.mma_async.sync", ""), dense


def test_logits_storage_within_budget():
    p = rank_slice_problem(20000, 4, 3, heads=64, head_dim=128, topk=2048, max_logits_bytes=5_000_000)
    be = BACKENDS["triton"]
    n = pool_table(p.seq.real_cu_seq_lens, 4)[0].numel()
    C = be.chunk_rows(p, n)
    pooled = be.pools(p, pool_table(p.seq.real_cu_seq_lens, 4)[0].cuda())
    z = torch.zeros(C, dtype=torch.int32, device="cuda")
    w = fold_bf16_weights(p.head_weights[:C], 64, 128)
    sc = be.score(p, pooled, p.q[:C], w, 0, n, z, z + n).scores
    nbytes = sc.untyped_storage().nbytes()
    assert nbytes <= p.max_logits_bytes, f"rows={C} bytes={nbytes} budget={p.max_logits_bytes}"
