"""Rows per scoring chunk (``agreement.scoring_chunk_rows``): packed short documents get
larger chunks whose logits still fit the budget; one document keeps the chunk of the
whole width; the results do not depend on the chunk."""

import dataclasses

import pytest
import torch

from sp_kpool.agreement import num_pools, scoring_chunk_rows
from sp_kpool.backends import BACKENDS
from sp_kpool.pipeline import solve
from sp_kpool.plan import plan_chunks
from sp_kpool.testing.problems import rank_slice_problem


def _problem(lengths, budget):
    return rank_slice_problem(sum(lengths), 2, 1, heads=4, head_dim=16, topk=16, lengths=lengths, device="cpu",
                              max_logits_bytes=budget)  # fmt: skip


@pytest.mark.parametrize("lengths", [[64] * 64, [1000, 24, 3000, 72], [4096]])
def test_chunks_fit_the_budget_and_grow_with_short_documents(lengths):
    budget = 4 * 2**20  # at least 128 rows of the whole width (the torch backend: ~28 bytes per cell)
    p = _problem(lengths, budget)
    be = BACKENDS["torch"]
    P = num_pools(p.seq, 4)
    C = scoring_chunk_rows(be, p, P)
    assert C >= be.chunk_rows(p, P)
    if len(lengths) == 1:  # one document: the chunk of the whole width
        assert C == be.chunk_rows(p, P)
    if lengths == [64] * 64:
        assert C > be.chunk_rows(p, P)
    seq = p.seq
    plan = plan_chunks(seq, 4, C, seq.shard_start, min(seq.shard_end, seq.num_real_tokens), p.device, cache=False)
    for c in plan.chunks:  # every chunk's logits within the budget at the backend's bytes per cell
        assert be.chunk_rows(p, max(1, c.pool_hi - c.pool_lo)) >= C, (c, C)


def test_results_do_not_depend_on_the_chunk(monkeypatch):
    import sp_kpool.agreement as ag

    p = _problem([64] * 40 + [300, 17], 4 * 2**20)
    be = BACKENDS["torch"]
    P = num_pools(p.seq, 4)
    assert scoring_chunk_rows(be, p, P) > be.chunk_rows(p, P)  # the two runs chunk differently
    got = solve(p, "torch").ids
    monkeypatch.setattr(ag, "scoring_chunk_rows", lambda be, pr, P: be.chunk_rows(pr, P))
    want = solve(dataclasses.replace(p), "torch").ids
    assert torch.equal(got, want)


def test_budget_below_one_row_still_raises():
    with pytest.raises(ValueError, match="max_logits_bytes: expected at least"):
        scoring_chunk_rows(BACKENDS["torch"], _problem([64] * 8, 8), 128)


def test_causal_balance_keeps_the_whole_width_block():
    from sp_kpool.agreement import call_of
    from sp_kpool.config import RunOptions

    p = _problem([64] * 64, 4 * 2**20)
    be = BACKENDS["torch"]
    P = num_pools(p.seq, 4)
    assert call_of(p, RunOptions(backend="torch")).chunk == scoring_chunk_rows(be, p, P) > be.chunk_rows(p, P)
    balanced = call_of(p, RunOptions(backend="torch", balance="causal"))
    assert balanced.chunk == be.chunk_rows(p, P)
    assert balanced.partition is not None and balanced.partition.block == be.chunk_rows(p, P)


def test_chunk_rows_are_kept_per_batch():
    p = _problem([64] * 64, 4 * 2**20)
    be = BACKENDS["torch"]
    P = num_pools(p.seq, 4)
    C = scoring_chunk_rows(be, p, P)
    assert len(p.seq.batch.section("chunks")) == 1
    assert scoring_chunk_rows(be, p, P) == C and len(p.seq.batch.section("chunks")) == 1
    other = dataclasses.replace(p, config=dataclasses.replace(p.config, max_logits_bytes=2 * 2**20))
    assert scoring_chunk_rows(be, other, P) < C  # the budget is in the key
    assert len(p.seq.batch.section("chunks")) == 2


def test_one_chunk_of_scores_alive_at_a_time(monkeypatch):
    """When a chunk is scored, nothing holds the previous chunk's scores any more: the peak
    memory of a call is one chunk's logits, not two."""
    import weakref

    p = _problem([4096], 1 * 2**20)  # one document, a small budget: several chunks
    be = BACKENDS["torch"]
    real, alive, chunks = be.score, [], []

    def score(*args):
        alive.append(any(ref() is not None for ref in chunks))
        out = real(*args)
        chunks.append(weakref.ref(out.scores))
        return out

    monkeypatch.setattr(be, "score", score)
    solve(p, "torch")
    assert len(chunks) >= 3, len(chunks)
    assert alive == [False] * len(chunks)
