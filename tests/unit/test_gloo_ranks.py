"""Real collectives: gloo ranks spawned from pytest (FileStore, no ports)."""

import pytest

from sp_kpool.testing.dist import run_ranks
from sp_kpool.testing.rank_checks import STANDARD_CASES, bad_input_on_one_rank, sharded_vs_world1

pytestmark = pytest.mark.xdist_group("ranks")


def _case_runner(rank, world_size):
    reports = []
    for lengths, kpool, topk in STANDARD_CASES:
        for tail, order in (("fixed", "ascending"), ("compact", "score")):
            reports.append(sharded_vs_world1(rank, world_size, lengths, kpool, topk, seed=len(lengths), tail=tail, order=order))
    return reports


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gloo_ranks_equal_world_size_one(world_size):
    results = run_ranks(_case_runner, world_size, timeout=180)
    for reports in results:
        for rep in reports:
            assert rep.equal, rep
    # the cases cover a shard that holds only padding ([5] on 4 ranks: shard [6, 8))
    if world_size == 4:
        assert any(rep.real_rows == 0 for reports in results for rep in reports)


@pytest.mark.parametrize("case, text", [
    ("shape", "k: expected shape [8, 16] (rows: seq.shard_size; D: q.shape[2], gates.shape[1], ape.shape[1]), got [8, 15]"),
    ("topk", "topk: per rank"),
    ("dtype", "gates: expected a floating-point dtype"),
    # each rank's input is valid, the ranks' dtypes differ: agreed before the gather (which
    # gloo would abort on, killing the process)
    ("float dtype", "q.dtype: per rank ['float32', 'float32', 'bfloat16']"),
])  # fmt: skip
def test_bad_input_on_one_rank_fails_on_every_rank_alike(case, text):
    messages = run_ranks(bad_input_on_one_rank, 3, (case,), timeout=120)
    assert len(set(messages)) == 1, messages
    assert text in messages[0], messages[0]


def test_logits_budget_too_small_fails_on_every_rank_alike():
    # 4 ranks on 5 tokens: the last shard holds only padding and scores nothing, yet it
    # raises the same error as the others
    messages = run_ranks(bad_input_on_one_rank, 4, ("budget",), timeout=120)
    assert len(set(messages)) == 1, messages
    assert "max_logits_bytes: expected at least" in messages[0], messages[0]
