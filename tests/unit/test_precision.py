"""The precision switch: env default read once, serving preparation in FP32, serving
selections equal to a direct recomputation, and sharded bitwise equality in every mode."""

import pytest
import torch

from sp_kpool import KPoolIndexer, ShardedSequence, kpool_topk, serving, serving_scores
from sp_kpool.pooling import pool_table
from sp_kpool.precision import default_precision, resolve_precision
from sp_kpool.testing.invariants import check_invariants, row_token_sets
from sp_kpool.testing.problems import make_inputs, shard_inputs, simulate_ranks


@pytest.fixture
def fresh_default():
    from sp_kpool.settings import current_settings

    current_settings.cache_clear()
    yield
    current_settings.cache_clear()


def test_env_default_is_read_once(monkeypatch, fresh_default):
    monkeypatch.setenv("SP_KPOOL_PRECISION", "fp8")
    assert resolve_precision(None) == "fp8"
    monkeypatch.setenv("SP_KPOOL_PRECISION", "bf16-serving")
    assert resolve_precision(None) == "fp8"  # cached: workers must restart to change it
    assert resolve_precision("bf16") == "bf16"


def test_env_default_unset_and_invalid(monkeypatch, fresh_default):
    monkeypatch.delenv("SP_KPOOL_PRECISION", raising=False)
    assert default_precision() == "bf16"
    from sp_kpool.settings import current_settings

    current_settings.cache_clear()
    monkeypatch.setenv("SP_KPOOL_PRECISION", "int4")
    with pytest.raises(ValueError, match=r"SP_KPOOL_PRECISION: expected one of \['bf16', 'bf16-serving', 'fp8'\], got 'int4'"):
        default_precision()


def test_bad_precision_argument():
    x = make_inputs([9], heads=8, head_dim=16, kpool=4)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    with pytest.raises(ValueError, match="precision: expected one of"):
        kpool_topk(**shard_inputs(x, seq), seq=seq, topk=8, precision="fp4")
    with pytest.raises(ValueError, match="precision: expected one of"):
        KPoolIndexer(hidden_size=8, q_lora_rank=4, index_n_heads=2, index_head_dim=4, index_topk=8, precision="x")


def test_fp8_needs_power_of_two_head_dim():
    x = make_inputs([9], heads=8, head_dim=12, kpool=4)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    with pytest.raises(ValueError, match="power-of-two head dim .* got D = 12"):
        kpool_topk(**shard_inputs(x, seq), seq=seq, topk=8, precision="fp8")


def _direct_sets(x, precision, topk, kpool):
    """Selections recomputed on the whole sequence at once, stable sort, no chunking."""
    cu = torch.tensor(x.cu_seq_lens)
    starts, offs = pool_table(cu, kpool)
    if precision == "fp8":
        k8, ks = serving.prepare_pools_fp8(x.k, x.gates, x.ape, starts)
        q8, wq = serving.prepare_queries_fp8(x.q, x.head_weights)
        scores = serving_scores.mqa_logits_fp8_reference(q8, wq, k8, ks)
    else:
        pools = serving.prepare_pools_bf16_serving(x.k, x.gates, x.ape, starts)
        scores = serving_scores.scores_bf16_serving(x.q, x.head_weights, pools)
    sets = []
    for t in range(cu[-1]):
        d = int(torch.searchsorted(cu, t, right=True)) - 1
        j = t - int(cu[d])
        lo, n = int(offs[d]), (j + 1) // kpool
        order = torch.sort(scores[t, lo : lo + n] + 0.0, descending=True, stable=True).indices[: topk // kpool] + lo
        ids = {int(starts[p]) + s for p in order.tolist() for s in range(kpool)}
        ids |= set(range(t - (j + 1) % kpool + 1, t + 1))
        sets.append(frozenset(ids))
    return sets


@pytest.mark.parametrize("precision", ["bf16-serving", "fp8"])
def test_serving_modes_select_what_a_direct_recomputation_selects(precision):
    x = make_inputs([150, 3, 77], heads=16, head_dim=32, kpool=4, seed=4)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    out = kpool_topk(**shard_inputs(x, seq), seq=seq, topk=16, precision=precision, max_logits_bytes=50_000)
    check_invariants(out, seq, topk=16, kpool=4, tail="fixed")
    got, want = row_token_sets(out), _direct_sets(x, precision, 16, 4)
    assert sum(a != b for a, b in zip(got, want)) <= 2  # FP32 matmul shape changes may flip a near-tie
    assert sum(a == b for a, b in zip(got, want)) >= len(want) - 2


@pytest.mark.parametrize("precision", ["bf16", "bf16-serving", "fp8"])
@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_every_mode_is_bitwise_equal_across_world_sizes(precision, world_size):
    x = make_inputs([61, 1, 2, 90, 33], heads=8, head_dim=16, kpool=4, seed=world_size)
    opts = dict(topk=16, kpool=4, precision=precision, max_logits_bytes=30_000, order="score", tail="compact")
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    ref = kpool_topk(**shard_inputs(x, seq), seq=seq, **opts)
    got = torch.cat(simulate_ranks(x, world_size, **opts))[: ref.shape[0]]
    assert torch.equal(got, ref)


def test_modes_differ_but_mostly_agree():
    x = make_inputs([300], heads=16, head_dim=32, kpool=4, seed=9)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    sets = {p: row_token_sets(kpool_topk(**shard_inputs(x, seq), seq=seq, topk=32, precision=p)) for p in ("bf16", "bf16-serving", "fp8")}
    agree = sum(a == b for a, b in zip(sets["bf16"], sets["fp8"]))
    assert 0.5 * 300 < agree < 300  # fp8 rounding flips some, not most, selections


def _indexer(precision, dtype=torch.bfloat16):
    m = KPoolIndexer(hidden_size=32, q_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=16,
                     precision=precision, dtype=dtype)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


@pytest.mark.parametrize("precision", ["bf16-serving", "fp8"])
def test_serving_preparation_is_fp32_and_ignores_autocast(precision):
    m = _indexer(precision)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, 32, generator=g).bfloat16()
    q_resid = torch.randn(40, 16, generator=g).bfloat16()
    plain = m.prepare(hidden, q_resid)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = m.prepare(hidden, q_resid)
    for name in plain:
        assert torch.equal(plain[name], auto[name]), name
    kx = hidden @ m.wk.weight.t()
    want_k = torch.nn.functional.layer_norm(kx.float(), (16,), m.k_norm.weight.float(), m.k_norm.bias.float(), 1e-6)
    assert torch.equal(plain["k"], want_k.bfloat16())
    # the head gate stays FP32 (serving's weights_proj(x.float()), not rounded back)
    want_w = hidden.float() @ m.weights_proj.weight.float().t()
    assert plain["head_weights"].dtype == torch.float32 and torch.equal(plain["head_weights"], want_w)
    seq = ShardedSequence.split([0, 40], world_size=1, rank=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(m(hidden, q_resid, seq), m(hidden, q_resid, seq))
