"""torch.compile: the operator is one opaque custom operator (``torch.ops.sp_kpool.kpool_topk``).

A tiny module with a ``KPoolIndexer`` inside compiles with ``fullgraph=True`` and dynamic
shapes into one graph that does not recompile for new sequence lengths, document splits or
``ShardedSequence`` objects, and gives the eager ids; the keyword form of ``kpool_topk``
likewise; the operator passes ``torch.library.opcheck`` (schema, fake implementation);
activation checkpointing recomputes the same ids (eager and compiled); on gloo ranks the
process group crosses the graph by its name. The compile backend is ``aot_eager`` (the
fake implementation and AOT dispatch, without a C++ toolchain); the transformers model under
``torch.compile`` is in ``test_integrations_transformers.py``.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils.checkpoint import checkpoint

import sp_kpool
from sp_kpool import KPoolIndexer, ShardedSequence, op
from sp_kpool.settings import Settings
from sp_kpool.testing.dist import run_ranks
from sp_kpool.testing.problems import make_inputs, shard_inputs

HID, QLR, H, D = 32, 16, 4, 8


def make_indexer(seed=0, **kw):
    torch.manual_seed(seed)
    ind = KPoolIndexer(hidden_size=HID, q_lora_rank=QLR, index_n_heads=H, index_head_dim=D, index_topk=16,
                       index_kpool=4, **kw)  # fmt: skip
    for p in ind.parameters():
        p.data.normal_()
    return ind


class Block(torch.nn.Module):
    """A linear layer, the indexer, and a use of its ids (the selected rows of ``v``)."""

    def __init__(self, indexer):
        super().__init__()
        self.lin = torch.nn.Linear(HID, HID)
        self.indexer = indexer

    def forward(self, hidden, q_resid, seq, v):
        ids = self.indexer(self.lin(hidden), q_resid, seq)
        picked = v[ids.clamp(min=0).long()] * (ids >= 0)[..., None]
        return ids, picked.sum(1)


def _sequences(layout="contiguous"):
    for docs in ([37, 20], [50, 1, 12, 70], [300], [3, 5]):
        cu = torch.tensor([0] + torch.tensor(docs).cumsum(0).tolist())
        yield ShardedSequence.split(cu, 1, 0, layout=layout)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("layout", ["contiguous", "zigzag-per-document"])
def test_module_compiles_fullgraph_once_for_every_length(layout):
    block = Block(make_indexer())
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(1)
    first = None
    with torch.no_grad():
        for seq in _sequences(layout):
            n = seq.shard_size
            h, qr, v = (torch.randn(n, HID, generator=g), torch.randn(n, QLR, generator=g),
                        torch.randn(n, 5, generator=g))  # fmt: skip
            t0 = time.perf_counter()
            ids, out = compiled(h, qr, seq, v)
            if first is None:
                first, frames_after_first = time.perf_counter() - t0, counter.frame_count
            want_ids, want_out = block(h, qr, seq, v)
            assert ids.dtype == torch.int32 and ids.shape == (n, 19)
            assert torch.equal(ids, want_ids) and torch.equal(out, want_out)
    # one graph at the first call, none after (no recompilation for new lengths and splits)
    assert frames_after_first == counter.frame_count, (frames_after_first, counter.frame_count)
    graphs = [gm for gm in counter.graphs if len(gm.graph.nodes)]
    assert len(graphs) == 1, [gm.code for gm in graphs]
    # the operator is one node of it, not the library's internals
    ops = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "sp_kpool" in str(n.target)]
    assert len(ops) == 1 and str(ops[0].target) == "sp_kpool.kpool_topk", [str(n.target) for n in ops]
    assert first < 60, first  # seconds, not minutes (aot_eager)


def test_kpool_topk_keyword_form_compiles_fullgraph():
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def f(q, k, gates, head_weights, ape, seq):
        return sp_kpool.kpool_topk(q, k, gates, head_weights, ape, seq, topk=8, order="ascending-unused-first",
                                   alignment=16)  # fmt: skip

    for docs in ([30, 17], [9, 80, 4]):
        x = make_inputs(docs, heads=H, head_dim=D, kpool=4, seed=len(docs))
        seq = ShardedSequence.split(x.cu_seq_lens, 1, 0)
        a = shard_inputs(x, seq)
        want = sp_kpool.kpool_topk(**a, seq=seq, topk=8, order="ascending-unused-first", alignment=16)
        assert torch.equal(f(a["q"], a["k"], a["gates"], a["head_weights"], a["ape"], seq), want)
    assert counter.frame_count <= 2  # the first call's graph(s) only, no recompilation


def test_first_compiled_call_that_first_reads_the_settings_compiles_one_frame():
    """The keyword form reads the process settings when none are passed; when the first
    compiled call is the process's first read, the read must not leave a guard that the
    next call fails (a guard on the settings' cache compiled a second frame)."""
    from sp_kpool.settings import current_settings

    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def f(q, k, gates, head_weights, ape, seq):
        return sp_kpool.kpool_topk(q, k, gates, head_weights, ape, seq, topk=8)

    calls = []
    for docs in ([30, 17], [9, 80, 4], [5, 60]):
        x = make_inputs(docs, heads=H, head_dim=D, kpool=4, seed=len(docs))
        seq = ShardedSequence.split(x.cu_seq_lens, 1, 0)
        calls.append((shard_inputs(x, seq), seq))
    current_settings.cache_clear()  # the first compiled call is the first read of this process
    for a, seq in calls:
        got = f(a["q"], a["k"], a["gates"], a["head_weights"], a["ape"], seq)
        assert torch.equal(got, sp_kpool.kpool_topk(**a, seq=seq, topk=8))
    assert counter.frame_count == 1, counter.frame_count


def test_stats_are_eager_only():
    x = make_inputs([20], heads=H, head_dim=D, kpool=4)
    seq = ShardedSequence.split(x.cu_seq_lens, 1, 0)

    @torch.compile(backend="eager", fullgraph=True)
    def f(q, k, gates, head_weights, ape):
        return sp_kpool.kpool_topk(q, k, gates, head_weights, ape, seq, topk=8, stats={})

    with pytest.raises(Exception, match="stats: not available under torch.compile"):
        f(**shard_inputs(x, seq))


def test_operator_opcheck():
    # schema, fake (meta) implementation against the real one, AOT dispatch with dynamic shapes
    x = make_inputs([23, 14], heads=H, head_dim=D, kpool=4, seed=2)
    seq = ShardedSequence.split(x.cu_seq_lens, 1, 0, layout="zigzag")
    a = shard_inputs(x, seq)
    s = seq.op_arguments
    settings = Settings(comm_timeout=60.0, tilelang_config=(64, 2, 128))
    args = (a["q"], a["k"], a["gates"], a["head_weights"], a["ape"], s.documents, list(s.rank_positions), s.world_size, s.rank, s.group_name, s.layout, 8, 4, "fixed", "ascending", 8,
            "bf16", 1 << 26, "torch", "keys", "none", -1, -1, False,
            "\n".join(repr(getattr(settings, n)) for n in op.SETTINGS_FIELDS))  # fmt: skip
    torch.library.opcheck(torch.ops.sp_kpool.kpool_topk.default, args)
    assert op._settings(args[-1]) == settings  # every field crosses, by its repr
    got = torch.ops.sp_kpool.kpool_topk(*args)
    assert torch.equal(got, sp_kpool.kpool_topk(**a, seq=seq, topk=8, alignment=8))
    rows = torch.arange(seq.shard_size) % 3 == 1  # rows=: the last, optional argument
    torch.library.opcheck(torch.ops.sp_kpool.kpool_topk.default, args + (rows,))
    got = torch.ops.sp_kpool.kpool_topk(*args, rows)
    assert torch.equal(got, sp_kpool.kpool_topk(**a, seq=seq, topk=8, alignment=8, rows=rows))
    assert torch.equal(got[rows], sp_kpool.kpool_topk(**a, seq=seq, topk=8, alignment=8)[rows])


def test_rows_cross_the_compiled_graph():
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def f(q, k, gates, head_weights, ape, seq, rows):
        return sp_kpool.kpool_topk(q, k, gates, head_weights, ape, seq, topk=8, rows=rows)

    for docs in ([30, 17], [9, 80, 4]):
        x = make_inputs(docs, heads=H, head_dim=D, kpool=4, seed=len(docs))
        seq = ShardedSequence.split(x.cu_seq_lens, 1, 0)
        a = shard_inputs(x, seq)
        rows = torch.arange(0, seq.shard_size, 5)
        full = sp_kpool.kpool_topk(**a, seq=seq, topk=8)
        got = f(a["q"], a["k"], a["gates"], a["head_weights"], a["ape"], seq, rows)
        assert torch.equal(got[rows], full[rows]) and int((got >= 0).sum()) == int((full[rows] >= 0).sum())
    assert counter.frame_count <= 2


@pytest.mark.parametrize("compiled", [False, True])
def test_checkpoint_recomputes_the_same_ids(compiled):
    block = Block(make_indexer(seed=3))
    seen = []
    inner = block.indexer.forward

    def recording(*args):
        ids = inner(*args)
        seen.append(ids)
        return ids

    seq = next(_sequences())
    g = torch.Generator().manual_seed(4)
    n = seq.shard_size
    h, qr = torch.randn(n, HID, generator=g), torch.randn(n, QLR, generator=g)
    v = torch.randn(n, 5, generator=g, requires_grad=True)

    def loss_of(fn):
        _, out = fn(h, qr, seq, v)
        return (out**2).sum()

    plain = loss_of(block)
    (want,) = torch.autograd.grad(plain, v)
    want_ids = block(h, qr, seq, v)[0]

    def region(h, qr, seq, v):
        return checkpoint(block, h, qr, seq, v, use_reentrant=False)

    if compiled:
        region = torch.compile(region, backend="aot_eager", fullgraph=True, dynamic=True)
    else:
        block.indexer.forward = recording
    loss = loss_of(region)
    (got,) = torch.autograd.grad(loss, v)
    assert torch.equal(got, want) and torch.equal(loss, plain)
    if not compiled:  # the forward and the recomputation in backward
        assert len(seen) == 2 and torch.equal(seen[0], seen[1]) and torch.equal(seen[0], want_ids)


def _compiled_ranks_case(rank, world_size):
    import torch.distributed as dist

    torch.set_num_threads(1)
    group = dist.new_group(list(range(world_size)))  # a named group, not the default one
    block = Block(make_indexer(seed=5, gather="pools"))
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True, dynamic=True)
    report = []
    for layout, docs in (("contiguous", [37, 20]), ("zigzag", [50, 1, 12, 70]), ("contiguous", [131, 7, 2])):
        cu = torch.tensor([0] + torch.tensor(docs).cumsum(0).tolist())
        seq = ShardedSequence.split(cu, world_size, rank, group, layout=layout)
        g = torch.Generator().manual_seed(len(docs))
        total = seq.total_length
        h, qr, v = torch.randn(total, HID, generator=g), torch.randn(total, QLR, generator=g), torch.randn(total, 5)
        rows = seq.positions
        with torch.no_grad():
            ids = compiled(h[rows], qr[rows], seq, v)[0]
            eager = block(h[rows], qr[rows], seq, v)[0]
        report.append((layout, torch.equal(ids, eager), bool((ids >= 0).any())))
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return report, frames


@pytest.mark.xdist_group("ranks")
def test_compiled_ranks_equal_eager_over_a_named_group():
    results = run_ranks(_compiled_ranks_case, 2, timeout=300)
    for rank, (report, frames) in enumerate(results):
        for layout, same, selects in report:
            assert same and selects, (rank, layout, same, selects)
        assert frames <= 2, (rank, frames)  # contiguous and zigzag: different constants, no per-length graph
