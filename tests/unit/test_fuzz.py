"""Fuzz: random packed layouts x world sizes 1-4 x options, bitwise equal to world size 1;
random bad inputs, each a ValueError/TypeError naming its argument.

Derandomized under CI (``tests/conftest.py``). The ranks are simulated in this process
(:func:`sp_kpool.testing.problems.simulate_ranks`: everything after the all-gather is the
real code path); real gloo ranks with bad input are in ``test_faults.py``.
"""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sp_kpool import KPoolIndexer, ShardedSequence, kpool_topk
from sp_kpool.registry import backend_names
from sp_kpool.testing.invariants import check_invariants
from sp_kpool.testing.problems import make_inputs, shard_inputs, simulate_ranks


@st.composite
def problems(draw):
    kpool = draw(st.sampled_from([1, 2, 3, 4, 8]))
    lengths = draw(st.lists(st.integers(1, 4 * kpool + 12), min_size=1, max_size=7))
    opts = dict(
        kpool=kpool,
        topk=kpool * draw(st.integers(1, 5)),
        tail=draw(st.sampled_from(["fixed", "compact"])),
        order=draw(st.sampled_from(["ascending", "score"])),
        alignment=draw(st.sampled_from([1, 4, 16])),
        precision=draw(st.sampled_from(["bf16", "bf16-serving", "fp8"])),
        # a small budget: several scoring chunks (at least one row of every pool fits)
        max_logits_bytes=draw(st.sampled_from([1 << 20, 80 * (sum(lengths) // kpool + 1)])),
    )
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return lengths, opts, dtype, draw(st.integers(0, 2**16))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_random_layouts_every_world_size_equals_world_size_one(problem):
    lengths, opts, dtype, seed = problem
    x = make_inputs(lengths, heads=4, head_dim=8, kpool=opts["kpool"], seed=seed, dtype=dtype)
    seq1 = ShardedSequence.split(np.array(x.cu_seq_lens), world_size=1, rank=0)  # integer-like inputs too
    ref = kpool_topk(**shard_inputs(x, seq1), seq=seq1, **{**opts, "topk": np.int64(opts["topk"])})
    check_invariants(ref, seq1, topk=opts["topk"], kpool=opts["kpool"], tail=opts["tail"], alignment=opts["alignment"])
    for world_size in (1, 2, 3, 4):
        for r, out in enumerate(simulate_ranks(x, world_size, **opts)):
            seq = ShardedSequence.split(x.cu_seq_lens, world_size=world_size, rank=r)
            lo, hi = seq.shard_start, min(seq.shard_end, seq.num_real_tokens)
            n = max(0, hi - lo)
            assert torch.equal(out[:n], ref[lo:hi]), f"rank {r} of {world_size} differs from world size 1"
            assert bool((out[n:] == -1).all()), f"padding rows of rank {r} of {world_size}"


def _good():
    x = make_inputs([13, 6], heads=4, head_dim=8, kpool=4, seed=0)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    return shard_inputs(x, seq), seq


#: argument -> strategy of bad values (each must raise, naming the argument)
BAD_OPTIONS = {
    "topk": st.one_of(st.integers(-5, 0), st.sampled_from([3, 6, 2**33, 2.0, True, "8", None, np.float32(8)])),
    "kpool": st.one_of(st.integers(-3, 0), st.sampled_from([1.5, False, np.bool_(True), torch.tensor(4.0)])),
    "tail": st.text(max_size=8).filter(lambda t: t not in ("fixed", "compact")),
    "order": st.text(max_size=8).filter(lambda t: t not in ("ascending", "score", "serving")),
    "alignment": st.one_of(st.integers(-3, 0), st.just(2.5)),
    "precision": st.text(max_size=8).filter(lambda t: t not in ("bf16", "bf16-serving", "fp8")),
    "max_logits_bytes": st.one_of(st.integers(-3, 50), st.just("1GiB")),
    "backend": st.one_of(st.text(max_size=8).filter(lambda t: t != "auto" and t not in backend_names()),
                         st.just(3)),
    "gather": st.text(max_size=6).filter(lambda t: t not in ("keys", "pools")),
    "balance": st.text(max_size=6).filter(lambda t: t not in ("none", "causal")),
    "balance_block": st.one_of(st.integers(-3, 0), st.just(1.0)),
    "balance_row_cost": st.one_of(st.integers(-3, -1), st.just("1")),
    "check_finite": st.sampled_from([1, "yes", 0.0]),
}  # fmt: skip
TENSORS = ("q", "k", "gates", "head_weights", "ape")


@st.composite
def bad_tensors(draw):
    name = draw(st.sampled_from(TENSORS))
    how = draw(st.sampled_from(["rows", "cols", "dims", "int", "numpy", "list", "nan", "inf"]))
    return name, how


def _spoil(t: torch.Tensor, how: str):
    if how == "rows":
        return t[:-1]
    if how == "cols":
        return t[..., :-1]
    if how == "dims":
        return t[None]
    if how == "int":
        return t.to(torch.int32)
    if how == "numpy":
        return t.numpy()
    if how == "list":
        return t.tolist()
    t = t.clone()
    t.view(t.shape[0], -1)[t.shape[0] // 2, 0] = float("nan") if how == "nan" else float("inf")
    return t


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(sorted(BAD_OPTIONS)).flatmap(lambda n: st.tuples(st.just(n), BAD_OPTIONS[n])))
def test_random_bad_option_names_it(bad):
    name, value = bad
    args, seq = _good()
    kw = {"topk": 8, "kpool": 4, name: value}
    with pytest.raises((TypeError, ValueError)) as info:
        kpool_topk(**args, seq=seq, **kw)
    assert str(info.value).startswith(f"{name}:") or f"{name}: " in str(info.value), (name, value, str(info.value))


@settings(max_examples=60, deadline=None)
@given(bad_tensors())
def test_random_bad_tensor_names_it(bad):
    name, how = bad
    args, seq = _good()
    args[name] = _spoil(args[name], how)
    with pytest.raises((TypeError, ValueError)) as info:
        kpool_topk(**args, seq=seq, topk=8, kpool=4, check_finite=True)
    # q sets H and D: a q with other columns is reported by the first tensor it disagrees with
    named = ("q", "k") if (name, how) == ("q", "cols") else (name,)
    assert str(info.value).split(":")[0] in named, (name, how, str(info.value))
    if how in ("nan", "inf"):
        assert "expected finite values (check_finite)" in str(info.value)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["index_topk", "index_kpool", "hidden_size", "tail", "order", "backend", "gather",
                        "precision", "alignment", "balance_block", "check_finite"]),  # fmt: skip
       st.sampled_from([0, -1, "nope", 2.5, True]))
def test_random_bad_indexer_option_fails_at_construction(name, value):
    kw = dict(hidden_size=8, q_lora_rank=4, index_n_heads=2, index_head_dim=4, index_topk=8)
    if value is True and name == "check_finite":
        value = "nope"  # True is a valid check_finite
    with pytest.raises((TypeError, ValueError)) as info:
        KPoolIndexer(**{**kw, name: value})
    assert str(info.value).startswith(f"{name}:"), (name, value, str(info.value))
