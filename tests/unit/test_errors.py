"""Bad input: clear errors naming the argument, expected and actual value."""

import pytest
import torch

from sp_kpool import KPoolIndexer, ShardedSequence, kpool_topk
from sp_kpool.testing.problems import make_inputs, shard_inputs


def _args(S=23, world_size=1, rank=0):
    x = make_inputs([S], heads=8, head_dim=16, kpool=4, seed=0)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=world_size, rank=rank)
    return shard_inputs(x, seq), seq


def _bad(fn):
    args, seq = _args()
    kw = dict(topk=8, kpool=4)
    fn(args, kw)
    return args, seq, kw


CASES = [
    (lambda a, k: a.update(q=a["q"][0]), ValueError, "q: expected shape [*, *, *], got [8, 16]"),
    (lambda a, k: a.update(q=a["q"][:-1]), ValueError, "q: expected 23 local rows"),
    (lambda a, k: a.update(k=a["k"][:, :8]), ValueError, "k: expected shape [23, 16], got [23, 8]"),
    (lambda a, k: a.update(gates=a["gates"][:5]), ValueError, "gates: expected shape [23, 16], got [5, 16]"),
    (lambda a, k: a.update(head_weights=a["head_weights"][:, :4]), ValueError, "head_weights: expected shape [23, 8], got [23, 4]"),
    (lambda a, k: a.update(ape=a["ape"][:3]), ValueError, "ape: expected shape [4, 16], got [3, 16]"),
    (lambda a, k: a.update(k=a["k"].to(torch.int64)), TypeError, "k: expected a floating-point dtype, got torch.int64"),
    (lambda a, k: a.update(q=a["q"].numpy()), TypeError, "q: expected a torch.Tensor, got ndarray"),
    (lambda a, k: a.update(k=a["k"].to("meta")), ValueError, "k: expected device cpu (the device of q), got meta"),
    (lambda a, k: k.update(topk=10), ValueError, "topk: expected a multiple of kpool = 4, got 10"),
    (lambda a, k: k.update(kpool=0), ValueError, "kpool: expected >= 1, got 0"),
    (lambda a, k: k.update(topk=0), ValueError, "topk: expected >= 1, got 0"),
    (lambda a, k: k.update(tail="end"), ValueError, "tail: expected one of ['fixed', 'compact'], got 'end'"),
    (lambda a, k: k.update(order="random"), ValueError, "order: expected one of ['ascending', 'score', 'serving'], got 'random'"),
    (lambda a, k: k.update(order="serving"), ValueError, "order 'serving' needs the CUDA serving selector, inputs are on cpu"),
    (lambda a, k: k.update(alignment=0), ValueError, "alignment: expected >= 1, got 0"),
    (lambda a, k: k.update(backend="cuda-magic"), ValueError, "backend: expected one of ['auto', 'torch'"),
    (lambda a, k: k.update(max_logits_bytes=10), ValueError, "max_logits_bytes: expected at least"),
]


@pytest.mark.parametrize("mutate, exc, text", CASES)
def test_bad_input_is_named(mutate, exc, text):
    args, seq, kw = _bad(mutate)
    with pytest.raises(exc) as info:
        kpool_topk(**args, seq=seq, **kw)
    assert text in str(info.value)


def test_seq_must_be_a_sharded_sequence():
    args, _ = _args()
    with pytest.raises(TypeError, match="seq: expected a ShardedSequence, got list"):
        kpool_topk(**args, seq=[0, 23], topk=8)


def test_cu_seq_lens_not_matching_the_data():
    args, _ = _args(S=23)
    seq = ShardedSequence.split([0, 30], world_size=1, rank=0)
    with pytest.raises(ValueError, match="q: expected 30 local rows"):
        kpool_topk(**args, seq=seq, topk=8)


def test_env_budget_is_validated(monkeypatch):
    from sp_kpool.settings import Settings, current_settings

    with pytest.raises(ValueError, match="SP_KPOOL_MAX_LOGITS_BYTES: expected a positive integer"):
        Settings.from_env({"SP_KPOOL_MAX_LOGITS_BYTES": "lots"})
    # the process settings are read at the first call that needs them
    args, seq = _args()
    monkeypatch.setenv("SP_KPOOL_MAX_LOGITS_BYTES", "lots")
    current_settings.cache_clear()
    try:
        with pytest.raises(ValueError, match="SP_KPOOL_MAX_LOGITS_BYTES: expected a positive integer"):
            kpool_topk(**args, seq=seq, topk=8)
    finally:
        current_settings.cache_clear()


def test_indexer_rejects_bad_config_and_inputs():
    with pytest.raises(ValueError, match="index_topk: expected a multiple of index_kpool = 4, got 10"):
        KPoolIndexer(hidden_size=8, q_lora_rank=4, index_n_heads=2, index_head_dim=4, index_topk=10)
    with pytest.raises(ValueError, match="index_n_heads: expected >= 1, got 0"):
        KPoolIndexer(hidden_size=8, q_lora_rank=4, index_n_heads=0, index_head_dim=4, index_topk=8)
    m = KPoolIndexer(hidden_size=8, q_lora_rank=4, index_n_heads=2, index_head_dim=4, index_topk=8)
    seq = ShardedSequence.split([0, 5], world_size=1, rank=0)
    with pytest.raises(ValueError, match=r"hidden: expected shape \[S_local, 8\], got \[5, 7\]"):
        m(torch.zeros(5, 7), torch.zeros(5, 4), seq)
    with pytest.raises(ValueError, match="q_resid: expected 5 rows"):
        m(torch.zeros(5, 8), torch.zeros(4, 4), seq)
