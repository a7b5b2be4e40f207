"""The selector registry and the fused seam (:mod:`sp_kpool.selectors`,
:func:`sp_kpool.scoring.select_chunks`): which selector serves which request and why not,
and that the pipeline hands a chunk to a registered fused selector when it supports the
call, with the same ids, counted in ``stats``."""

import pytest
import torch

import sp_kpool
from sp_kpool import selectors
from sp_kpool.selectors import FusedSelector, SelectRequest, choose, choose_fused, select_pools
from sp_kpool.testing.problems import make_inputs, shard_inputs, simulate_ranks

CUDA = torch.device("cuda")


def test_cpu_requests_take_the_int64_reference():
    assert choose(SelectRequest(512, 4096, "ascending", torch.device("cpu"))).name == "int64-keys"
    assert choose(SelectRequest(8, 10, "score", torch.device("cpu"), ranges=False)).name == "int64-keys"


def test_serving_order_has_only_the_serving_selector():
    with pytest.raises(ValueError, match="order: 'serving' needs CUDA, lmdeploy and k in"):
        choose(SelectRequest(512, 4096, "serving", torch.device("cpu")))
    # every other selector says why it does not serve order="serving"
    for s in selectors.SELECTORS.values():
        if s.kind == "dense" and s.name != "serving":
            assert any("serving" in r for r in s.not_supported_reasons(SelectRequest(512, 4096, "serving", CUDA)))


def test_cuda_requests_in_priority_order(monkeypatch):
    # the CUDA dispatch as before the registry: Triton when it supports the shape, then
    # LMDeploy's radix selector (k 512/2048 and ranges), then the int64 keys
    monkeypatch.setattr(selectors, "_triton_select", lambda k, width: (lambda *a: None) if k <= 2048 else None)
    monkeypatch.setattr(selectors, "_radix_selector", lambda k: (lambda *a: None) if k in (512, 2048) else None)
    assert choose(SelectRequest(512, 4096, "ascending", CUDA)).name == "triton"
    assert choose(SelectRequest(4096, 8192, "score", CUDA)).name == "int64-keys"
    monkeypatch.setattr(selectors, "_triton_select", lambda k, width: None)
    assert choose(SelectRequest(512, 4096, "ascending", CUDA)).name == "radix"
    assert choose(SelectRequest(512, 4096, "ascending", CUDA, ranges=False)).name == "int64-keys"
    assert choose(SelectRequest(512, 4096, "serving", CUDA)).name == "serving"
    assert not selectors.reads_row_ranges_only(512, 4096, "ascending")
    monkeypatch.setattr(selectors, "_triton_select", lambda k, width: (lambda *a: None))
    assert selectors.reads_row_ranges_only(512, 4096, "ascending")
    assert not selectors.reads_row_ranges_only(512, 4096, "serving")


def test_describe_lists_every_selector_with_reasons():
    rows = selectors.describe(torch.device("cpu"))
    names = [r[0] for r in rows]
    assert {"triton", "radix", "int64-keys", "serving"} <= set(names) and "fp32-candidates" not in names
    by = {r[0]: r for r in rows}
    assert by["int64-keys"][3] == [] and by["triton"][3] == ["needs CUDA, got cpu"]


class _ScoreThenSelect(FusedSelector):
    """A fused selector for the torch backend that scores, then selects with the reference:
    what a fused kernel must equal. ``shift`` corrupts its ids (to show the seam is used)."""

    name = "test-fused"
    priority = 99
    backends = ("torch",)
    precisions = ("bf16", "bf16-serving", "fp8")

    def __init__(self, shift=0):
        self.shift = shift
        self.rows = 0

    def score_select(self, backend, problem, pools, call, out):
        c = call.chunk
        sc = backend.score(problem, pools, call.q, call.w, c.pool_lo, c.pool_hi, call.starts, call.ends)
        rows = call.rows
        starts, ends = call.starts[rows], call.ends[rows]
        cols = torch.arange(c.pool_hi - c.pool_lo)
        visible = (cols[None] >= starts[:, None]) & (cols[None] < ends[:, None])
        k = problem.topk // problem.kpool
        select_pools(sc.scores[rows], visible, k, c.pool_lo, ends, order="ascending", starts=starts, out=out)
        if self.shift:
            out.add_(self.shift * (out >= 0))
        self.rows += call.b - call.a
        return {"candidates": (out >= 0).sum(), "candidates_max": int((out >= 0).sum(1).max()), "overflow_rows": 0}


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("world_size", [1, 3])
def test_pipeline_uses_a_registered_fused_selector(monkeypatch, precision, world_size):
    x = make_inputs([700, 1, 333, 1000], heads=4, head_dim=16, kpool=4, seed=world_size)
    kw = dict(topk=64, kpool=4, precision=precision, max_logits_bytes=1 << 16)
    want = simulate_ranks(x, world_size, **kw)
    fused = _ScoreThenSelect()
    monkeypatch.setitem(selectors.SELECTORS, fused.name, fused)
    got = simulate_ranks(x, world_size, **kw)
    # the rows of every chunk that has pools went through it (a chunk without pools is -1)
    assert x.cu_seq_lens[-1] - 8 <= fused.rows <= x.cu_seq_lens[-1]
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # a wrong fused selector shows in the output: the seam really routes through it
    monkeypatch.setitem(selectors.SELECTORS, fused.name, _ScoreThenSelect(shift=1))
    assert any(not torch.equal(g, w) for g, w in zip(simulate_ranks(x, world_size, **kw), want))


def test_fused_counters_reach_stats(monkeypatch):
    x = make_inputs([900, 400], heads=2, head_dim=16, kpool=4, seed=3)
    fused = _ScoreThenSelect()
    monkeypatch.setitem(selectors.SELECTORS, fused.name, fused)
    seq = sp_kpool.ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    stats = {}
    sp_kpool.kpool_topk(**shard_inputs(x, seq), seq=seq, topk=32, kpool=4, max_logits_bytes=1 << 15, stats=stats)
    sel = stats["selection"]
    assert sel["selector"] == "test-fused" and sel["fused_chunks"] >= 2 and sel["overflow_rows"] == 0
    assert 0 < sel["candidates_max"] <= 8 and isinstance(sel["candidates"], int)
    # without a fused selector the stats say so
    monkeypatch.delitem(selectors.SELECTORS, fused.name)
    stats = {}
    sp_kpool.kpool_topk(**shard_inputs(x, seq), seq=seq, topk=32, kpool=4, stats=stats)
    assert stats["selection"] == {}


def test_fused_selector_reasons():
    class Other(FusedSelector):
        name, backends, precisions = "x", ("deepgemm",), ("fp8",)

    class B:
        name = "torch"

    class P:
        precision = "bf16"

    why = Other().not_supported_reasons(B(), P())
    assert why == ["backend 'torch' not in ['deepgemm']", "precision 'bf16' not in ['fp8']"]
    assert choose_fused(B(), P()) is None
