"""A rank waiting in the agreement explains the wait: after ``comm_log_interval`` seconds,
and again every as many seconds, it logs which ranks have not arrived; the timeout is
unchanged (``TimeoutError`` after ``comm_timeout``)."""

import logging
import time

import pytest
import torch

from sp_kpool.settings import Settings
from sp_kpool.testing.dist import run_ranks

pytestmark = pytest.mark.xdist_group("ranks")


def _one_rank_never_calls(rank, world_size, absent):
    import torch.distributed as dist

    from sp_kpool import ShardedSequence, kpool_topk
    from sp_kpool.testing.problems import make_inputs

    if rank == absent:
        time.sleep(9)  # alive, never calls; returns after the others timed out
        return None
    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logging.getLogger("sp_kpool").addHandler(Keep())
    x = make_inputs([13], heads=2, head_dim=4, kpool=2, seed=0)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size, rank, dist.group.WORLD)
    settings = Settings(comm_timeout=5.0, comm_log_interval=1.5)
    t0 = time.monotonic()
    try:
        kpool_topk(seq.local_rows(x.q), seq.local_rows(x.k), seq.local_rows(x.gates), seq.local_rows(x.head_weights),
                   x.ape, seq, topk=4, kpool=2, settings=settings)  # fmt: skip
        error = None
    except TimeoutError as exc:
        error = str(exc)
    return error, time.monotonic() - t0, messages


def test_a_rank_that_never_calls_is_named_while_the_others_wait():
    results = run_ranks(_one_rank_never_calls, 3, args=(1,), timeout=90, pg_timeout=60)
    for rank in (0, 2):
        error, waited, messages = results[rank]
        assert error is not None and "not every rank answered within 5 s" in error
        assert 4.5 < waited < 8, waited  # the timeout is unchanged by the log
        assert len(messages) >= 2, messages  # after 1.5 s, then every 1.5 s
        for m in messages:
            assert f"sp_kpool: rank {rank} of 3 has waited" in m and "in the agreement" in m
            assert "rank(s) [1] of 3 have not arrived" in m and "SP_KPOOL_COMM_LOG_INTERVAL" in m
    assert results[1] is None


def test_log_interval_is_a_setting():
    assert Settings().comm_log_interval == 30.0
    assert Settings.from_env({"SP_KPOOL_COMM_LOG_INTERVAL": "2.5"}).comm_log_interval == 2.5
    with pytest.raises(ValueError, match="SP_KPOOL_COMM_LOG_INTERVAL: expected a positive number of seconds, got 0"):
        Settings(comm_log_interval=0)
    with pytest.raises(ValueError, match="SP_KPOOL_COMM_LOG_INTERVAL: expected a positive number of seconds, got 'x'"):
        Settings.from_env({"SP_KPOOL_COMM_LOG_INTERVAL": "x"})
