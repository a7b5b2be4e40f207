"""Random inputs, H 32/64, D 128, topk 2048, kpool 4 (gpu_check section ``tilelang-random``):
rows where tilelang and torch differ are near-ties only (float64 scores), repeated runs
and a small logits budget are bitwise identical, the budget bounds the real logits storage."""

import dataclasses

import pytest
import torch

from sp_kpool.backends import BACKENDS
from sp_kpool.pooling import pool_table
from sp_kpool.testing.gpu_checks import bf16_row_scores, ids_of, near_tie_rows
from sp_kpool.testing.problems import rank_slice_problem

pytestmark = [pytest.mark.requires("tilelang"), pytest.mark.xdist_group("gpu")]

CASES = [(8192 + 3, 4, 3, [5000, 7, 3188]), (16384, 4, 3, None),
         pytest.param(65536, 4, 3, None, marks=pytest.mark.slow)]  # fmt: skip
HEADS = (32, 64)


def _run(cache, H, total, ws, rank, lengths):
    """The problem and tilelang's output, computed once per case for the three checks."""
    key = (H, total)
    if key not in cache:
        p = rank_slice_problem(total, ws, rank, heads=H, head_dim=128, topk=2048, lengths=lengths, seed=H)
        cache[key] = p, ids_of("tilelang", p)
    return cache[key]


@pytest.mark.parametrize("total,ws,rank,lengths", CASES)
@pytest.mark.parametrize("H", HEADS)
def test_differing_rows_are_near_ties(cache, H, total, ws, rank, lengths):
    p, a = _run(cache, H, total, ws, rank, lengths)
    b = ids_of("torch", p)
    pooled = BACKENDS["torch"].pools(p, pool_table(p.seq.real_cu_seq_lens, 4)[0].cuda())
    ndiff, bad = near_tie_rows(p, a, b, bf16_row_scores(p, pooled))
    assert not bad, f"rows={a.shape[0]} differing_rows={ndiff} beyond_near_tie={bad[:5]}"


@pytest.mark.parametrize("total,ws,rank,lengths", CASES)
@pytest.mark.parametrize("H", HEADS)
def test_repeat_bitwise(cache, H, total, ws, rank, lengths):
    p, a = _run(cache, H, total, ws, rank, lengths)
    assert torch.equal(a, ids_of("tilelang", p))


@pytest.mark.parametrize("total,ws,rank,lengths", CASES)
@pytest.mark.parametrize("H", HEADS)
def test_small_budget_bitwise(cache, H, total, ws, rank, lengths):
    p, a = _run(cache, H, total, ws, rank, lengths)
    assert torch.equal(a, ids_of("tilelang", dataclasses.replace(p, config=p.config.replace(max_logits_bytes=3 * 2**20 + 12345))))


def test_logits_storage_within_budget():
    p = rank_slice_problem(20000, 4, 3, heads=64, head_dim=128, topk=2048, max_logits_bytes=5_000_000)
    be = BACKENDS["tilelang"]
    n = pool_table(p.seq.real_cu_seq_lens, 4)[0].numel()
    C = be.chunk_rows(p, n)
    pooled = be.pools(p, pool_table(p.seq.real_cu_seq_lens, 4)[0].cuda())
    z = torch.zeros(C, dtype=torch.int32, device="cuda")
    sc = be.score(p, pooled, p.q[:C], p.head_weights[:C], 0, n, z, z + n).scores
    nbytes = sc.untyped_storage().nbytes()
    assert nbytes <= p.max_logits_bytes, f"rows={C} bytes={nbytes} budget={p.max_logits_bytes}"
