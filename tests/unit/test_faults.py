"""The fault suite: one rank wrong, dead or absent; every rank must raise, alike and soon.

Gloo ranks on CPU (``run_ranks``: spawned processes, a FileStore per call). Each case runs
under a hard wall-clock limit (``run_ranks``' ``timeout``), so a hang fails the test
instead of blocking CI; no case measures time.
"""

import multiprocessing

import pytest
import torch

from sp_kpool import ShardedSequence, kpool_topk
from sp_kpool.testing.dist import RanksFailed, run_ranks
from sp_kpool.testing.fault_cases import (
    AGREED_FAULTS,
    LENGTHS,
    agreed_faults,
    indexer_faults,
    local_call_on_one_rank,
    rank_dies,
    rank_never_calls,
)
from sp_kpool.testing.problems import make_inputs, shard_inputs

pytestmark = pytest.mark.xdist_group("ranks")

#: the hard limit of one spawn (a hang fails here); the agreement's timeout in the cases
#: that leave a rank out is fault_cases.COMM_TIMEOUT (5 s)
LIMIT = 150


def _no_rank_left():
    left = [p for p in multiprocessing.active_children() if p.name.startswith("sp_kpool-rank")]
    assert not left, left


def _check_alike(outcomes: list, name: str, text: str):
    kinds = {o[0] for o in outcomes}
    messages = {o[1] for o in outcomes}
    assert len(kinds) == 1 and len(messages) == 1, (name, outcomes)
    kind, message = outcomes[0]
    if text:
        assert kind in ("ValueError", "TypeError"), (name, outcomes[0])
        assert text in message, (name, message)
    else:
        assert kind == "no error", (name, outcomes[0])


@pytest.fixture(scope="module")
def agreed_two_ranks():
    return run_ranks(agreed_faults, 2, (list(AGREED_FAULTS),), timeout=LIMIT)


@pytest.mark.parametrize("name", list(AGREED_FAULTS))
def test_one_rank_wrong_every_rank_raises_alike(agreed_two_ranks, name):
    _check_alike([r[name] for r in agreed_two_ranks], name, AGREED_FAULTS[name][1])
    _no_rank_left()


def test_the_faulty_rank_is_named_with_its_value(agreed_two_ranks):
    # the local error names the rank, the argument and the value; a disagreement names the
    # values of every rank and the rank that differs
    assert agreed_two_ranks[0]["gates int32"][1].startswith("invalid input on rank 1 of 2:\n  rank 1: TypeError: gates")
    assert "precision: per rank ['bf16', 'fp8'] (rank 1 differs)" in agreed_two_ranks[0]["precision"][1]
    assert agreed_two_ranks[0]["q numpy"][0] == "TypeError"  # as at world size 1


def test_a_list_that_differs_is_named_at_its_first_differing_entry(agreed_two_ranks):
    # not only the digests: the first entry of cu_seq_lens / the rows / prompt_lens that
    # differs, and each rank's value there (LENGTHS [23, 6]; the last rank passes [20, 9])
    message = agreed_two_ranks[0]["seq other documents"][1]
    assert "cu_seq_lens (crc32): per rank [" in message
    assert "(rank 1 differs); first differing entry cu_seq_lens[1]: per rank [23, 20]" in message, message
    message = agreed_two_ranks[0]["seq other rows"][1]  # 29 rows: [0, 15) and [15, 29), vs [0, 14) and [14, 29)
    assert "rows per rank (crc32): per rank [" in message
    assert "first differing entry the number of rows of rank 0: per rank [15, 14]" in message, message
    message = agreed_two_ranks[0]["seq prompt_lens"][1]
    assert "(rank 1 differs); prompt_lens per rank [None, [8, 0]]" in message, message


def test_integer_like_values_give_the_plain_rows(agreed_two_ranks):
    x = make_inputs(LENGTHS, heads=8, head_dim=16, kpool=4, seed=3)
    seq1 = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    plain = kpool_topk(**shard_inputs(x, seq1), seq=seq1, topk=8, kpool=4)  # world size 1, Python ints
    for rank in range(2):
        seq = ShardedSequence.split(x.cu_seq_lens, world_size=2, rank=rank)
        lo, hi = seq.shard_start, min(seq.shard_end, seq.num_real_tokens)
        for name in ("numpy topk", "0-d tensor kpool", "numpy cu_seq_lens"):
            assert torch.equal(agreed_two_ranks[rank][name + " ids"][: hi - lo], plain[lo:hi]), name


def test_four_ranks_one_wrong():
    names = ["env precision", "seq not a ShardedSequence", "seq rank 0", "seq world size + 1", "k bfloat16",
             "precision", "nan in k", "gates int32", "numpy topk"]  # fmt: skip
    results = run_ranks(agreed_faults, 4, (names,), timeout=LIMIT)
    for name in names:
        _check_alike([r[name] for r in results], name, AGREED_FAULTS[name][1].split(" per rank")[0])
    assert "precision: per rank ['bf16', 'bf16', 'bf16', 'fp8'] (rank 3 differs)" in results[0]["precision"][1]
    assert "rank 3: ValueError: k: expected finite values (check_finite), got nan in local row 2 (stream position 26) " \
        "on rank 3" in results[0]["nan in k"][1]
    _no_rank_left()


def test_indexer_bad_hidden_on_one_rank():
    results = run_ranks(indexer_faults, 2, timeout=LIMIT)
    expected = {
        "hidden float64": "hidden: expected dtype torch.float32 (the parameters' dtype",
        "hidden shape": "hidden: expected shape [S_local, 16], got [15, 15]",
        "env precision": "SP_KPOOL_PRECISION: expected one of",
        "good": "",
    }
    for name, text in expected.items():
        _check_alike([r[name] for r in results], name, text)
    _no_rank_left()


@pytest.mark.parametrize("when", ["before", "mid"])
def test_a_rank_that_dies_does_not_block_the_others(when):
    with pytest.raises(RanksFailed) as info:
        run_ranks(rank_dies, 3, (when,), timeout=LIMIT, grace=60)
    err = info.value
    assert err.failed == [2] and err.statuses[2] == "exited with code 3", str(err)
    assert "rank 2 of 3 ranks of rank_dies failed (exited with code 3)" in str(err)
    # the survivors raised by themselves (within the grace), not killed
    assert sorted(err.results) == [0, 1], err.statuses
    for r in (0, 1):
        kind, message = err.results[r]
        assert kind in ("RuntimeError", "TimeoutError"), err.results[r]
    if when == "before":  # in the agreement: the same message on every survivor
        assert err.results[0] == err.results[1], err.results
        assert "agreement:" in err.results[0][1]
    _no_rank_left()


def test_a_rank_that_never_calls_times_out_the_others_and_is_ended():
    with pytest.raises(RanksFailed) as info:
        run_ranks(rank_never_calls, 3, timeout=LIMIT, grace=2)
    err = info.value
    assert sorted(err.failed) == [0, 1] and err.rank in (0, 1), str(err)
    assert err.statuses[2] == "killed: still running 2 s after rank %d failed" % err.rank, err.statuses
    for r in (0, 1):
        assert "TimeoutError: agreement: not every rank answered within 5 s (SP_KPOOL_COMM_TIMEOUT)" in err.errors[r]
    _no_rank_left()


def test_a_local_call_on_one_rank_does_not_block_the_others():
    # a world-size-1 sequence without a group is a local call: its rank raises its own
    # error; the others raise by the timeout or when that rank's process has ended
    results = run_ranks(local_call_on_one_rank, 2, timeout=LIMIT)
    assert results[1][0] == "ValueError" and "q: expected 29 local rows" in results[1][1], results[1]
    assert results[0][0] in ("TimeoutError", "RuntimeError") and "agreement:" in results[0][1], results[0]
    _no_rank_left()

