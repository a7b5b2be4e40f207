import dataclasses

import pytest
import torch

from sp_kpool import KPoolConfig, ShardedSequence, kpool_topk
from sp_kpool.pooling import compress_pools_bf16, pool_table
from sp_kpool.selection import assemble, output_width, row_meta, score_keys, topk_pools
from sp_kpool.testing.invariants import check_invariants
from sp_kpool.testing.problems import make_inputs, shard_inputs


def test_pool_table_restarts_at_documents_and_skips_partial_pools():
    starts, offs = pool_table(torch.tensor([0, 9, 14, 14, 15, 23]), 4)
    # doc0 len 9: pools at 0, 4; doc1 len 5: pool at 9; doc2 empty; doc3 len 1: none; doc4 len 8: 15, 19
    assert starts.tolist() == [0, 4, 9, 15, 19]
    assert offs.tolist() == [0, 2, 3, 3, 3, 5]


def test_row_meta_causal_prefix_and_tail():
    cu = torch.tensor([0, 9, 14])
    _, offs = pool_table(cu, 4)
    m = row_meta(torch.arange(16), cu, offs, 4)
    # doc0: j=0..8; doc1: j=0..4 (pools start at id 2); rows 14, 15 are padding
    assert m.n_visible.tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 0, 0, 0, 1, 1, 0, 0]
    assert m.tail_len.tolist() == [1, 2, 3, 0, 1, 2, 3, 0, 1, 1, 2, 3, 0, 1, 0, 0]
    assert m.pool_lo.tolist()[:14] == [0] * 9 + [2] * 5
    assert m.padding.tolist() == [False] * 14 + [True] * 2


@pytest.mark.parametrize("topk, kpool, alignment, want", [(2048, 4, 1, 2051), (2048, 4, 64, 2112), (2048, 4, 512, 2560), (8, 1, 1, 8), (16, 16, 8, 32)])
def test_output_width(topk, kpool, alignment, want):
    assert output_width(topk, kpool, alignment) == want


def test_score_keys_total_order_ties_toward_lower_column():
    s = torch.tensor([[0.0, -0.0, 1.0, 1.0, -2.0, float("inf"), -float("inf"), 3e-39, -3e-39]])
    keys = score_keys(s, torch.ones_like(s, dtype=torch.bool))
    order = torch.argsort(keys, descending=True)[0].tolist()
    # reference: a stable descending sort (ties lowest index first), with -0.0 == +0.0
    ref = torch.sort(s + 0.0, descending=True, stable=True).indices[0].tolist()
    assert order == ref == [5, 2, 3, 7, 0, 1, 8, 4, 6]


def test_topk_pools_matches_stable_sort_on_heavy_ties():
    g = torch.Generator().manual_seed(1)
    scores = torch.randint(-3, 4, (64, 50), generator=g).float() * 0.5  # many exact ties
    lo = torch.randint(0, 10, (64,), generator=g)
    hi = lo + torch.randint(0, 41, (64,), generator=g)
    cols = torch.arange(50)
    visible = (cols >= lo[:, None]) & (cols < hi[:, None])
    pools, valid = topk_pools(scores, visible, 8, col0=100)
    for r in range(64):
        masked = torch.where(visible[r], scores[r], torch.tensor(-float("inf")))
        order = torch.sort(masked, descending=True, stable=True).indices
        n = min(8, int(visible[r].sum()))
        assert pools[r, :n].tolist() == (order[:n] + 100).tolist()
        assert valid[r].tolist() == [True] * n + [False] * (8 - n)
        assert pools[r, n:].tolist() == [-1] * (8 - n)


@pytest.mark.parametrize("tail", ["fixed", "compact"])
def test_assemble_layouts(tail):
    cu = torch.tensor([0, 11])
    starts, offs = pool_table(cu, 4)
    meta = row_meta(torch.tensor([10]), cu, offs, 4)  # j = 10: pools 0, 1 visible, tail 8 9 10
    out = assemble(torch.tensor([[1, 0]]), meta, starts, topk=12, kpool=4, tail=tail, order="ascending", alignment=8)
    assert out.shape == (1, 16) and out.dtype == torch.int32
    if tail == "fixed":
        want = [0, 1, 2, 3, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, -1]
    else:
        want = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, -1, -1, -1, -1, -1]
    assert out[0].tolist() == want
    out = assemble(torch.tensor([[1, 0]]), meta, starts, topk=12, kpool=4, tail=tail, order="score", alignment=8)
    assert out[0, :8].tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
    # into a given destination (the driver's output rows): overwritten whole, same values
    dest = torch.full((1, 16), 77, dtype=torch.int32)
    got = assemble(torch.tensor([[1, 0]]), meta, starts, topk=12, kpool=4, tail=tail, order="score", alignment=8, out=dest)
    assert got.data_ptr() == dest.data_ptr() and torch.equal(dest, out)
    with pytest.raises(ValueError, match="out: expected an int32 tensor of shape"):
        assemble(torch.tensor([[1, 0]]), meta, starts, topk=12, kpool=4, tail=tail, order="score", alignment=8,
                 out=torch.zeros(1, 15, dtype=torch.int32))


def test_pool_table_against_a_loop():
    # packed documents, empty and shorter-than-K ones included
    cu = torch.tensor([0, 0, 3, 11, 12, 29, 29, 45])
    for kpool in (1, 4, 5):
        starts, offs = pool_table(cu, kpool)
        want, want_offs = [], [0]
        for d in range(len(cu) - 1):
            n = int(cu[d + 1] - cu[d]) // kpool
            want += [int(cu[d]) + kpool * i for i in range(n)]
            want_offs.append(want_offs[-1] + n)
        assert starts.dtype == torch.int64 and starts.tolist() == want
        assert offs.tolist() == want_offs


def test_pool_compression_matches_explicit_softmax():
    g = torch.Generator().manual_seed(3)
    k, gates = torch.randn(13, 8, generator=g), torch.randn(13, 8, generator=g) * 4
    ape = torch.randn(4, 8, generator=g)
    starts, _ = pool_table(torch.tensor([0, 5, 13]), 4)  # pools at 0, 5, 9
    pk = compress_pools_bf16(k, gates, ape, starts)
    for p, s0 in enumerate(starts.tolist()):
        w = torch.softmax(gates[s0 : s0 + 4].double() + ape.double(), dim=0)
        torch.testing.assert_close(pk[p].double(), (w * k[s0 : s0 + 4].double()).sum(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kpool", [1, 2, 4, 16])
@pytest.mark.parametrize("tail", ["fixed", "compact"])
@pytest.mark.parametrize("order", ["ascending", "score"])
def test_invariants_on_packed_documents(kpool, tail, order):
    lengths = [1, kpool - 1 or 1, 3 * kpool + 1, 37, 2, 70]
    topk = 4 * kpool
    x = make_inputs(lengths, heads=8, head_dim=16, kpool=kpool, seed=kpool)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    out = kpool_topk(**shard_inputs(x, seq), seq=seq, topk=topk, kpool=kpool, tail=tail, order=order, alignment=8)
    check_invariants(out, seq, topk=topk, kpool=kpool, tail=tail, alignment=8)


def test_order_ascending_and_score_select_the_same_sets():
    x = make_inputs([50, 61], heads=8, head_dim=16, kpool=4, seed=5)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    a = kpool_topk(**shard_inputs(x, seq), seq=seq, topk=16, order="ascending")
    s = kpool_topk(**shard_inputs(x, seq), seq=seq, topk=16, order="score")
    assert not torch.equal(a, s)  # rows with more than 4 visible pools reorder
    assert [set(r.tolist()) for r in a] == [set(r.tolist()) for r in s]
    hist = a[:, :16]
    for row in hist.tolist():
        starts = [v for v in row[::4] if v >= 0]
        assert starts == sorted(starts)


def test_invariant_checker_catches_a_broken_output():
    x = make_inputs([30], heads=8, head_dim=16, kpool=4, seed=0)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    out = kpool_topk(**shard_inputs(x, seq), seq=seq, topk=8)
    check_invariants(out, seq, topk=8, kpool=4, tail="fixed")
    for r, c, v in [(20, 0, 25), (20, 8, -1), (20, 1, 0), (3, 4, 0)]:
        bad = out.clone()
        bad[r, c] = v
        with pytest.raises(AssertionError):
            check_invariants(bad, seq, topk=8, kpool=4, tail="fixed")


@pytest.mark.parametrize("levels", [3, 1000, 10**6])
def test_fast_topk_equals_exact_topk(levels):
    # few levels: long tie runs at the boundary (fallback path); many: the candidate path
    from sp_kpool.selection import topk_pools_fast

    g = torch.Generator().manual_seed(levels)
    scores = torch.randint(-levels, levels, (96, 300), generator=g).float() / levels
    lo = torch.randint(0, 50, (96,), generator=g)
    hi = lo + torch.randint(0, 251, (96,), generator=g)
    cols = torch.arange(300)
    visible = (cols >= lo[:, None]) & (cols < hi[:, None])
    exact, _ = topk_pools(scores, visible, 32, col0=7)
    fast, _ = topk_pools_fast(scores.masked_fill(~visible, -float("inf")), 32, col0=7)
    assert torch.equal(fast, exact)


def _fake_radix_selector(seed):
    """A stand-in with LMDeploy's contract: *some* top-k set of [0, seqlen) in any order,
    ties at the threshold broken arbitrarily; rows with seqlen <= k return 0..seqlen-1."""
    g = torch.Generator().manual_seed(seed)

    def select(scores, q_seqlens, kv_seqlens, k):
        out = torch.full((scores.shape[0], k), -1, dtype=torch.int32)
        for r in range(scores.shape[0]):
            n = int(kv_seqlens[r])
            if n <= k:
                out[r, :n] = torch.arange(n)
                continue
            row = scores[r, :n]
            noise = torch.rand(n, generator=g)  # arbitrary order among equal values
            order = sorted(range(n), key=lambda i: (-float(row[i]), float(noise[i])))
            chosen = torch.tensor(order[:k])
            out[r] = chosen[torch.randperm(k, generator=g)].int()
        return out

    return select


@pytest.mark.parametrize("levels", [2, 50, 10**6])
def test_radix_selection_with_check_equals_exact(levels):
    from sp_kpool.selection import topk_pools_radix

    g = torch.Generator().manual_seed(levels)
    R, N, k = 40, 700, 512
    scores = torch.randint(-levels, levels, (R, N), generator=g).float()
    starts = torch.randint(0, 100, (R,), generator=g)
    ends = torch.minimum(starts + torch.randint(0, 700, (R,), generator=g), torch.tensor(N))
    cols = torch.arange(N)
    visible = (cols >= starts[:, None]) & (cols < ends[:, None])
    exact, _ = topk_pools(scores, visible, k, col0=3)
    masked = scores.masked_fill(~visible, -float("inf"))
    got, _ = topk_pools_radix(masked, ends, k, 3, _fake_radix_selector(levels))
    assert torch.equal(got, exact)
    unordered, _ = topk_pools_radix(masked, ends, k, 3, _fake_radix_selector(levels + 1), ordered=False)
    big = torch.iinfo(torch.int64).max
    as_sets = [torch.sort(t.masked_fill(t < 0, big)).values for t in (unordered, exact)]
    assert torch.equal(*as_sets)
    assert torch.equal((unordered >= 0).sum(1), (exact >= 0).sum(1))
    # assemble accepts the unordered set for ascending order
    cu = torch.tensor([0, 4 * N])
    starts_tab, offs = pool_table(cu, 4)
    meta = row_meta(torch.full((R,), 4 * N - 1), cu, offs, 4)
    a1 = assemble(unordered - 3, meta, starts_tab, topk=4 * k, kpool=4, tail="compact", order="ascending", alignment=1)
    a2 = assemble(exact - 3, meta, starts_tab, topk=4 * k, kpool=4, tail="compact", order="ascending", alignment=1)
    assert torch.equal(a1, a2)


def test_serving_order_keeps_the_selector_order_and_drops_invisible():
    from sp_kpool.selection import serving_pools

    scores = torch.tensor([[5.0, -float("inf"), 3.0, 9.0, 1.0, 7.0]])
    ends = torch.tensor([6])

    def selector(sc, q_seqlens, kv_seqlens, k):  # a fixed "atomic" order with an invisible pick
        return torch.tensor([[3, 1, 0, 5]], dtype=torch.int32)

    got = serving_pools(scores, ends, 4, 10, selector)
    assert got.tolist() == [[13, 10, 15, -1]]


@pytest.mark.parametrize("world_size, rank, budget", [(1, 0, 1 << 20), (3, 1, 40 * 4 * 64), (4, 3, 33 * 4 * 16)])
def test_plan_tables_match_pool_table_and_row_meta(world_size, rank, budget):
    # the plan's tables (grid from the document boundaries, pool_tok_start built from
    # [cu, offsets, shifts]) against pool_table / row_meta on the host
    from sp_kpool.backends import BACKENDS
    from sp_kpool.plan import plan_chunks
    from sp_kpool.testing.problems import rank_slice_problem

    lengths = [3, 0, 11, 1, 17, 4, 9]
    for kpool in (1, 4, 5):
        p = rank_slice_problem(sum(lengths), world_size, rank, heads=2, head_dim=8, kpool=kpool, topk=4 * kpool,
                               lengths=lengths, device="cpu", max_logits_bytes=budget)  # fmt: skip
        lo, hi = p.seq.shard_start, min(p.seq.shard_end, p.seq.num_real_tokens)
        starts, offs = pool_table(p.seq.real_cu_seq_lens, kpool)
        C = BACKENDS["torch"].chunk_rows(p, starts.numel())
        st = plan_chunks(p.seq, kpool, C, lo, hi, torch.device("cpu"), cache=False)
        assert st.num_pools == starts.numel() and torch.equal(st.pool_tok_start, starts)
        assert torch.equal(st.offs, offs) and torch.equal(st.cu, p.seq.real_cu_seq_lens)
        assert [c.first for c in st.chunks] == list(range((lo // C) * C, hi, C))
        for i, c in enumerate(st.chunks):
            m = row_meta(torch.tensor([c.first, c.end - 1]), p.seq.real_cu_seq_lens, offs, kpool)
            assert c.index == i and c.end == min(c.first + C, p.seq.num_real_tokens)
            assert (c.pool_lo, c.pool_hi) == (int(m.pool_lo[0]), int(m.pool_hi[1]))
            assert st.bounds[i].tolist() == [c.pool_lo, c.pool_hi]


def test_no_complete_pools_with_a_tiny_budget_gives_empty_rows_on_every_rank():
    # every document shorter than kpool: nothing is scored, so the logits budget is not
    # checked (before the check ran only on ranks with rows: they raised, the others did not)
    from sp_kpool.testing.problems import simulate_ranks

    x = make_inputs([3, 2, 1], heads=2, head_dim=8, kpool=4)
    ref = torch.cat(simulate_ranks(x, 1, topk=8, kpool=4, max_logits_bytes=8))
    assert bool((ref[:, :8] == -1).all())  # no history; the tail columns hold the rows' own tokens
    assert ref[:, 8].tolist() == [0, 0, 0, 3, 3, 5]
    for ws in (2, 3):
        out = torch.cat(simulate_ranks(x, ws, topk=8, kpool=4, max_logits_bytes=8))
        assert torch.equal(out[: ref.shape[0]], ref)


_PREPARED_X = dict(lengths=[37, 3, 60, 1, 29], heads=3, head_dim=8, kpool=4, seed=5)
_PREPARED_OPTS = dict(topk=16, kpool=4, max_logits_bytes=20 * 32 * 7)  # chunks of a few rows


def _prepared_cases(monkeypatch, backend):
    """``(world_size, rank outputs with backend, world-size-1 output of the torch backend,
    the rank sequences)`` for the prepared-rows tests: five documents, chunks of a few
    rows, world sizes 1, 2, 3 and 5. ``backend`` is registered as ``"custom"``."""
    from sp_kpool.backends import BACKENDS
    from sp_kpool.testing.problems import simulate_ranks

    monkeypatch.setitem(BACKENDS, "custom", backend)
    x = make_inputs(_PREPARED_X["lengths"], **{k: v for k, v in _PREPARED_X.items() if k != "lengths"})
    ref = torch.cat(simulate_ranks(x, 1, **_PREPARED_OPTS))
    for ws in (1, 2, 3, 5):
        seqs = [ShardedSequence.split(x.cu_seq_lens, world_size=ws, rank=r) for r in range(ws)]
        yield ws, simulate_ranks(x, ws, backend="custom", **_PREPARED_OPTS), ref, seqs


def _flipped(queries):
    """Query rows with their channels reversed (the test backends' score reverses them back)."""
    from sp_kpool.backends.base import QueryInputs

    return QueryInputs(queries.q.flip(-1), queries.w.flip(-1), queries.row, queries.before, queries.after)


def _real_rows(seq):
    return seq.shard_start, min(seq.shard_end, seq.num_real_tokens)


def test_pipeline_prepares_rows_once(monkeypatch):
    # a backend whose preparation changes the rows (channels reversed; score reverses them
    # back): the pipeline must prepare each call's rows exactly once and pass the prepared
    # rows (views of whole chunks, zero-padded copies of partial ones) to score; the result
    # equals the plain backend at every world size
    from sp_kpool.backends.torch_backend import TorchBackend

    calls = []

    class Flipped(TorchBackend):
        def prepare(self, problem, pools, queries):
            calls.append(queries.q.shape[0])
            return super().prepare(problem, pools, _flipped(queries))

        def score(self, problem, pools, q, w, lo, hi, starts=None, ends=None):
            return super().score(problem, pools, q.flip(-1), w.flip(-1), lo, hi, starts, ends)

    for _ws, out, ref, seqs in _prepared_cases(monkeypatch, Flipped()):
        assert torch.equal(torch.cat(out)[: ref.shape[0]], ref)
        n_real = [b - a for a, b in map(_real_rows, seqs)]
        assert calls == [n for n in n_real if n > 0]  # once per rank that has real rows
        calls.clear()


def test_pipeline_scores_padded_prepared_rows_from_views(monkeypatch):
    # a backend that writes the zero rows around its prepared rows itself: every chunk's
    # scoring call gets a view of the one prepared buffer (no copies), laid out on the
    # global chunk grid, and the result equals the plain backend at every world size
    from sp_kpool.backends.base import Queries
    from sp_kpool.backends.torch_backend import TorchBackend
    from sp_kpool.plan import grid_span

    seen = []

    class Padded(TorchBackend):
        def prepare(self, problem, pools, queries):
            pooled, _ = super().prepare(problem, pools, None)
            b, a = queries.before, queries.after
            qp = torch.nn.functional.pad(queries.q.flip(-1), (0, 0, 0, 0, b, a), value=0.0)
            wp = torch.nn.functional.pad(queries.w.flip(-1), (0, 0, b, a), value=0.0)
            seen.append({"q": qp, "w": wp, "before": b, "after": a, "chunks": []})
            return pooled, Queries(qp, wp, queries.row - b)

        def score(self, problem, pools, q, w, lo, hi, starts=None, ends=None):
            seen[-1]["chunks"].append((q, w))
            return super().score(problem, pools, q.flip(-1), w.flip(-1), lo, hi, starts, ends)

    padded_somewhere = False
    for _ws, out, ref, seqs in _prepared_cases(monkeypatch, Padded()):
        assert torch.equal(torch.cat(out)[: ref.shape[0]], ref)
        real = [s for s in seqs if _real_rows(s)[1] > _real_rows(s)[0]]
        mine, seen[:] = seen[:], []
        assert len(mine) == len(real)  # once per rank with real rows
        for seq, s in zip(real, mine):
            lo, hi = _real_rows(seq)
            C = s["chunks"][0][0].shape[0]
            assert (lo - s["before"], hi + s["after"]) == grid_span(C, lo, hi)
            padded_somewhere |= s["before"] + s["after"] > 0
            base_ptr, row_bytes = s["q"].data_ptr(), s["q"][0].nbytes
            offsets = [(q.data_ptr() - base_ptr) / row_bytes for q, _ in s["chunks"]]
            assert len(set(offsets)) == len(offsets) and all(o % C == 0 for o in offsets)  # views on the grid
            assert all(q.shape[0] == C and q._base is not None for q, _ in s["chunks"])
    assert padded_somewhere  # the split puts shard edges inside chunks


def test_pipeline_pools_and_prepares_in_one_step(monkeypatch):
    # the pipeline asks for the pools and the queries in one prepare call per rank that has
    # rows and pools, the queries' zero rows laid out to the global chunk grid; the result
    # equals the plain backend at every world size. Gathered pools (gather="pools") are not
    # built again: prepare is asked for the queries only.
    from sp_kpool.backends.torch_backend import TorchBackend
    from sp_kpool.pipeline import num_pools
    from sp_kpool.plan import grid_span

    calls = []

    class Fused(TorchBackend):
        def prepare(self, problem, pools, queries):
            calls.append((pools is not None, queries.q.shape[0] if queries is not None else None,
                          queries.before if queries else None, queries.after if queries else None))
            return super().prepare(problem, pools, queries)

    for _ws, out, ref, seqs in _prepared_cases(monkeypatch, Fused()):
        assert torch.equal(torch.cat(out)[: ref.shape[0]], ref)
        real = [s for s in seqs if _real_rows(s)[1] > _real_rows(s)[0]]
        mine, calls[:] = calls[:], []
        assert len(mine) == len(real)
        C = TorchBackend().chunk_rows(_problem_for(seqs[0]), num_pools(seqs[0], 4))
        for seq, (both, rows, before, after) in zip(real, mine):
            lo, hi = _real_rows(seq)
            assert both and rows == hi - lo and (lo - before, hi + after) == grid_span(C, lo, hi)
    x = make_inputs(_PREPARED_X["lengths"], **{k: v for k, v in _PREPARED_X.items() if k != "lengths"})
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    calls.clear()
    out = kpool_topk(**shard_inputs(x, seq), seq=seq, gather="pools", backend="custom", **_PREPARED_OPTS)
    assert torch.equal(out[: ref.shape[0]], ref)
    assert [c[0] for c in calls] == [True, False] and calls[0][1] is None  # local pools, then the queries alone


def _problem_for(seq):
    from sp_kpool.backends.base import Problem
    from sp_kpool.config import KPoolConfig

    z = torch.zeros
    return Problem(q=z(seq.shard_size, 3, 8), head_weights=z(seq.shard_size, 3), k=z(1, 8), gates=z(1, 8),
                   ape=z(4, 8), seq=seq, config=KPoolConfig(**_PREPARED_OPTS))  # fmt: skip


def test_reference_slice_problem_is_rank_3_of_4():
    from sp_kpool.settings import current_settings
    from sp_kpool.testing.problems import rank_slice_problem, reference_slice_problem

    p = reference_slice_problem(4, "fp8", total=64, seed=2, device="cpu")
    q = rank_slice_problem(64, 4, 3, heads=4, head_dim=128, topk=2048, precision="fp8", seed=2, device="cpu",
                           max_logits_bytes=current_settings().logits_budget("cpu"))  # fmt: skip
    assert (p.seq.shard_start, p.seq.shard_end, p.precision, p.max_logits_bytes) == (48, 64, "fp8", q.max_logits_bytes)
    assert torch.equal(p.q, q.q) and torch.equal(p.k, q.k)


def test_ids_of_a_gathered_problem_equal_the_simulated_rank():
    # the GPU checks' helper (tests/gpu): the ids of a rank's gathered problem by a backend
    # name are the ranks' outputs of the pipeline
    from sp_kpool.testing.gpu_checks import ids_of
    from sp_kpool.testing.problems import rank_slice_problem

    p = rank_slice_problem(50, 2, 1, heads=4, head_dim=16, kpool=4, topk=8, device="cpu", max_logits_bytes=4096)
    inputs = dict(q=p.q.float(), head_weights=p.head_weights.float(), k=p.k.float(), gates=p.gates.float(),
                  ape=p.ape.float())  # fmt: skip
    from sp_kpool.pipeline import run_gathered

    want = run_gathered(inputs, p.seq, p.config).ids
    got = ids_of("torch", dataclasses.replace(p, **inputs))
    assert torch.equal(got, want) and int((got >= 0).sum()) > 0


def test_default_path_pools_once_in_the_pipeline(monkeypatch):
    # gather="keys" without balance: the pipeline pools once, from the table its plan
    # stages on the device (equal to pool_table), with no second host-to-device copy
    import sp_kpool.pipeline as pipeline
    from sp_kpool.backends import BACKENDS

    be = BACKENDS["torch"]
    seen, planned = [], []
    orig_prepare, orig_plan = type(be).prepare, pipeline.plan_chunks

    def prepare(self, problem, pools, queries):
        seen.append(pools.pool_tok_start)
        return orig_prepare(self, problem, pools, queries)

    def plan_chunks(*args, **kw):
        planned.append(orig_plan(*args, **kw))
        return planned[-1]

    monkeypatch.setattr(type(be), "prepare", prepare)
    monkeypatch.setattr(pipeline, "plan_chunks", plan_chunks)
    x = make_inputs([37, 4, 50], heads=4, head_dim=16, kpool=4, seed=3)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    kpool_topk(**shard_inputs(x, seq), seq=seq, topk=8, backend="torch")
    assert len(seen) == 1 and len(planned) == 1
    assert seen[0] is planned[0].pool_tok_start
    assert torch.equal(seen[0], pool_table(seq.real_cu_seq_lens, 4)[0])


def test_to_device_returns_a_tensor_already_there():
    from sp_kpool._device import to_device

    t = torch.arange(5)
    assert to_device(t, "cpu") is t and to_device(t, torch.device("cpu")) is t


def test_plans_are_cached_on_the_sequence_by_value_and_give_the_same_answer(monkeypatch):
    # a second call on the same sequence reuses its plan (and the row ranges and row
    # metadata the plan keeps); other boundaries, another kpool or an in-place change of
    # cu_seq_lens build new ones; answers are equal to the uncached pipeline's
    import sp_kpool.plan as plan_mod
    from sp_kpool.pipeline import run_gathered
    from sp_kpool.settings import Settings
    from sp_kpool.testing.problems import rank_slice_problem

    built = []
    orig = plan_mod.to_device

    def to_device(t, device):  # the one host-to-device copy of every plan build
        built.append(t)
        return orig(t, device)

    monkeypatch.setattr(plan_mod, "to_device", to_device)
    problems = {}

    def call(lengths, kpool=4, settings=None):  # rank 1 of 2, several chunks; one sequence object per case
        key = (tuple(lengths), kpool)
        if key not in problems:
            problems[key] = rank_slice_problem(sum(lengths), 2, 1, heads=2, head_dim=8, kpool=kpool, topk=4 * kpool,
                                               lengths=lengths, device="cpu", max_logits_bytes=2048)  # fmt: skip
        p = problems[key]
        inputs = dict(q=p.q, head_weights=p.head_weights, k=p.k, gates=p.gates, ape=p.ape)
        return run_gathered(inputs, p.seq, p.config, settings=settings)

    first = call([37, 4, 50])
    assert len(built) == 1
    plan = first.plan
    assert plan._ranges is not None and plan._meta is not None and len(plan.chunks) > 1
    again = call([37, 4, 50])
    assert len(built) == 1 and torch.equal(first.ids, again.ids) and again.plan is plan
    other = call([40, 1, 50])  # same total, other boundaries
    assert len(built) == 2
    call([37, 4, 50], kpool=2)
    assert len(built) == 3
    off = Settings(table_cache=False)
    assert torch.equal(call([37, 4, 50], settings=off).ids, first.ids)
    assert torch.equal(call([40, 1, 50], settings=off).ids, other.ids)
    assert len(built) == 5
    with pytest.raises(ValueError, match="SP_KPOOL_TABLE_CACHE: expected 0 or 1, got 'yes'"):
        Settings.from_env({"SP_KPOOL_TABLE_CACHE": "yes"})
    # the key holds the boundaries' values: an in-place change of cu_seq_lens is a new key
    x = make_inputs([37, 4, 50], heads=4, head_dim=16, kpool=4, seed=5)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    n = len(built)
    kpool_topk(**shard_inputs(x, seq), seq=seq, topk=16, backend="torch")
    seq.cu_seq_lens[1] = 30  # the same object, other boundaries
    kpool_topk(**shard_inputs(x, seq), seq=seq, topk=16, backend="torch")
    assert len(built) == n + 2 and len(seq.tables) == 2
    seq.tables.clear()
    assert len(seq.tables) == 0


def test_plan_ranges_take_the_torch_path_on_a_gpu_without_triton(monkeypatch):
    # a CUDA device without Triton: the row ranges come from torch ops, not the Triton
    # kernel's module (which imports triton)
    import sp_kpool._device as device_mod
    import sp_kpool.plan as plan_mod
    from sp_kpool.plan import plan_chunks, row_ranges_torch

    seq = ShardedSequence.split([0, 37, 41, 91], world_size=2, rank=1)
    want = plan_chunks(seq, 4, 8, 46, 91, torch.device("cpu"), cache=False).ranges
    monkeypatch.setattr(device_mod, "on_gpu", lambda device: True)
    monkeypatch.setattr(plan_mod, "probe", lambda name: (None, f"{name} not importable"))
    plan = plan_chunks(seq, 4, 8, 46, 91, torch.device("cpu"), cache=False)
    assert torch.equal(plan.ranges, want)
    assert torch.equal(want, row_ranges_torch(plan.cu, plan.offs, plan.bounds, 46, 91, plan.first, 8, 4))


def test_prompt_lens_are_checked_however_the_sequence_is_built():
    seq = ShardedSequence(cu_seq_lens=torch.tensor([0, 5, 9]), shard_start=0, shard_size=9, rank=0, world_size=1,
                          prompt_lens=[4, 2])  # fmt: skip
    assert seq.prompt_lens == (4, 2) and seq.has_prompts
    with pytest.raises(ValueError, match=r"prompt_lens\[1\]: expected 0 <= prompt_lens\[1\] <= len = 4, got 5"):
        ShardedSequence(cu_seq_lens=torch.tensor([0, 5, 9]), shard_start=0, shard_size=9, rank=0, world_size=1,
                        prompt_lens=[4, 5])  # fmt: skip


def test_order_ascending_unused_first_is_ascending_moved_to_the_end_of_the_history():
    # XTuner's canonical columns: the same ids as "ascending", the unused slots first
    x = make_inputs([50, 61, 7], heads=8, head_dim=16, kpool=4, seed=5)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    topk = 32  # 8 slots: most rows of the short documents fill fewer
    a = kpool_topk(**shard_inputs(x, seq), seq=seq, topk=topk, order="ascending")
    u = kpool_topk(**shard_inputs(x, seq), seq=seq, topk=topk, order="ascending-unused-first")
    assert torch.equal(a[:, topk:], u[:, topk:])  # the tail columns are untouched
    for ra, ru in zip(a[:, :topk].tolist(), u[:, :topk].tolist()):
        used = [v for v in ra if v >= 0]
        assert ru == [-1] * (topk - len(used)) + used
    assert not torch.equal(a, u)


def test_order_ascending_unused_first_pads_a_narrow_selection():
    # fewer selected columns than topk // kpool (a chunk with fewer pools than slots)
    cu = torch.tensor([0, 9])
    pts, offs = pool_table(cu, 4)
    meta = row_meta(torch.tensor([3, 8]), cu, offs, 4)
    pools = torch.tensor([[0, -1], [1, 0]])
    out = assemble(pools, meta, pts, topk=16, kpool=4, tail="fixed", order="ascending-unused-first", alignment=1)
    assert out[0].tolist() == [-1] * 12 + [0, 1, 2, 3] + [-1] * 3
    assert out[1].tolist() == [-1] * 8 + list(range(8)) + [8, -1, -1]
    with pytest.raises(ValueError, match="order: 'ascending-unused-first' puts the unused history slots first"):
        KPoolConfig(topk=16, tail="compact", order="ascending-unused-first")


def test_short_row_hint_equals_the_rows_it_describes():
    # may_have_short_rows and short_rows_hint (host ints) against row_meta's n_visible of every
    # row of the range
    import random

    from sp_kpool.selectors import may_have_short_rows, short_rows_hint

    rng = random.Random(0)
    for _ in range(600):
        lens = [rng.randint(1, 60) for _ in range(rng.randint(1, 5))]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        kpool, k = rng.choice([1, 2, 4]), rng.randint(1, 12)
        a = rng.randint(0, cu[-1] + 3)
        b = rng.randint(a, cu[-1] + 6)
        _, offs = pool_table(torch.tensor(cu), kpool)
        m = row_meta(torch.arange(a, b), torch.tensor(cu), offs, kpool)
        want = bool(((m.n_visible <= k) & ~m.padding).any())
        assert may_have_short_rows(cu, a, b, k, kpool) == want, (cu, a, b, k, kpool)
        # "all": every real row of the range is short (a guarantee the selector relies on)
        real = ~m.padding
        every = bool(real.any() and (m.n_visible[real] <= k).all())
        hint = short_rows_hint(cu, a, b, k, kpool)
        assert (hint == "all") == every, (cu, a, b, k, kpool, hint)
        if hint != "all":
            assert hint == want


@pytest.mark.parametrize("world_size, rank", [(3, 1), (4, 3), (2, 0)])
def test_row_local_chunk_calls_are_the_padded_calls_rows_here(world_size, rank):
    # a backend with row_local_scores scores a partial chunk from views of its rows here:
    # the same rows, ranges and positions as the padded call's rows [a, b), and nothing else
    from sp_kpool.backends.base import Queries
    from sp_kpool.plan import plan_chunks
    from sp_kpool.scoring import chunk_calls
    from sp_kpool.testing.problems import rank_slice_problem

    lengths, kpool = [3, 0, 11, 1, 17, 4, 9, 30], 4
    p = rank_slice_problem(sum(lengths), world_size, rank, heads=2, head_dim=8, kpool=kpool, topk=4 * kpool,
                           lengths=lengths, device="cpu")  # fmt: skip
    lo, hi = p.seq.shard_start, min(p.seq.shard_end, p.seq.num_real_tokens)
    plan = plan_chunks(p.seq, kpool, 8, lo, hi, torch.device("cpu"), cache=False)
    q = torch.arange(1, 1 + (hi - lo) * 6, dtype=torch.float32).reshape(hi - lo, 3, 2)
    w = torch.arange(1, 1 + (hi - lo) * 3, dtype=torch.float32).reshape(hi - lo, 3)
    queries = Queries(q, w, lo)  # no zero rows around: partial chunks at both ends
    padded = list(chunk_calls(plan, queries, views_first=False))
    # the global grid's chunks, called as a row-local plan calls a chunk it covers in part
    local = list(chunk_calls(dataclasses.replace(plan, row_local=True), queries, views_first=False))
    assert [(c.a, c.b, c.chunk.index) for c in padded] == [(c.a, c.b, c.chunk.index) for c in local]
    partial = 0
    for pc, lc in zip(padded, local):
        if pc.q is None:
            assert lc.q is None
            continue
        assert pc.q.shape[0] == plan.rows and lc.q.shape[0] == lc.b - lc.a
        partial += lc.skip > 0 or lc.q.shape[0] < plan.rows
        assert lc.skip == (lc.a - lc.chunk.first if lc.q.shape[0] < plan.rows else 0)
        for t in ("q", "w", "starts", "ends"):
            assert torch.equal(getattr(pc, t)[pc.rows], getattr(lc, t)[lc.rows]), t
        assert lc.q.data_ptr() == q[lc.a - lo].data_ptr()  # a view, not a copy
        if lc.q.shape[0] == lc.b - lc.a:  # every call row is a row here
            assert lc.rows == slice(0, lc.b - lc.a)
    assert partial  # the case has partial chunks


def test_local_chunks_are_the_fewest_equal_chunks_from_the_span_start():
    from sp_kpool.plan import local_chunks, plan_chunks
    from sp_kpool.testing.problems import rank_slice_problem

    assert local_chunks(45, 90, 6) == 6  # 8 chunks, the last of 3 rows
    assert local_chunks(98304, 131072, 16256) == 10923  # 3 chunks, not 15488 + 16256 + 1024 rows
    assert local_chunks(7, 100, 500) == 93
    assert local_chunks(5, 5, 8) == 8
    lengths = [3, 0, 11, 1, 17, 4, 9, 30]
    for ws, rank, C in [(2, 1, 6), (3, 1, 7), (4, 3, 100), (1, 0, 1)]:
        p = rank_slice_problem(sum(lengths), ws, rank, heads=2, head_dim=8, kpool=4, topk=16, lengths=lengths,
                               device="cpu")  # fmt: skip
        lo, hi = p.seq.shard_start, min(p.seq.shard_end, p.seq.num_real_tokens)
        plan = plan_chunks(p.seq, 4, C, lo, hi, torch.device("cpu"), cache=False, row_local=True)
        rows = plan.rows
        assert rows <= C and plan.first == lo and plan.padding() == (0, 0)
        assert [c.first for c in plan.chunks] == list(range(lo, hi, rows)) and len(plan.chunks) == -(-(hi - lo) // C)
        assert all(plan.computed(c) == (c.first, min(c.first + rows, hi)) for c in plan.chunks)
