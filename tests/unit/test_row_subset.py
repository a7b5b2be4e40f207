"""``kpool_topk(rows=)``: only the rows asked for are computed, bit for bit the full call's.

The torch backend on the CPU scores each chunk's requested rows alone
(``Backend.scores_row_subsets``, :func:`sp_kpool.plan.plan_rows`): the first test shows that a row's score cells there do not
depend on which other rows share its scoring call (for every precision), which is what makes
the rows' ids the full call's. The others compare ``rows=`` with the full call for every
layout, at 1-4 simulated ranks (in one process) and on 2-4 gloo ranks, with empty row sets on
some ranks, padding rows asked for and rows of one-token documents.
"""

from __future__ import annotations

import pytest
import torch

from sp_kpool import KPoolConfig, ShardedSequence, kpool_topk
from sp_kpool.backends import resolve_backend
from sp_kpool.pipeline import run_gathered
from sp_kpool.scoring import chunk_calls
from sp_kpool.testing.dist import run_ranks
from sp_kpool.testing.problems import layout_seqs, make_inputs, random_rank_positions, shard_inputs
from sp_kpool.testing.rank_checks import layout_seq

LAYOUTS = ("contiguous", "zigzag", "zigzag-per-document", "positions")
#: one-token documents (1), pools straddling shard seams, odd lengths (padding in the split layouts)
LENGTHS = [37, 1, 3, 64, 1, 2, 46]
CU = [0]
for _n in LENGTHS:
    CU.append(CU[-1] + _n)
TOPK, KPOOL = 16, 4
#: a budget of a few rows per chunk: many chunks, most holding rows asked for and rows not
SMALL_BUDGET = 4 * 4 * 24 * 20


def _seqs(layout, world_size):
    if layout == "positions":
        return layout_seqs(CU, world_size, rank_positions=random_rank_positions(CU[-1], world_size, 5))
    return layout_seqs(CU, world_size, layout)


def _rows(seq: ShardedSequence, rank: int, seed: int, as_index: bool) -> torch.Tensor:
    """Rank ``rank``'s rows to ask for: none on rank 1, else about a third of the rows at
    random plus every padding row and every row of a one-token document; as a bool mask or an
    integer index (shuffled, one row twice)."""
    g = torch.Generator().manual_seed(seed + rank)
    mask = torch.rand(seq.shard_size, generator=g) < 0.35
    if rank == 1:
        mask[:] = False
    else:
        mask[seq.padding_rows] = True
        stream_doc = torch.searchsorted(seq.cu_seq_lens, seq.positions, right=True) - 1
        lengths = seq.cu_seq_lens[1:] - seq.cu_seq_lens[:-1]
        mask |= lengths[stream_doc] == 1
    if not as_index:
        return mask
    idx = torch.nonzero(mask).flatten()
    idx = idx[torch.randperm(idx.numel(), generator=g)]
    return torch.cat([idx, idx[:1]])


def _mask(rows: torch.Tensor, n: int) -> torch.Tensor:
    if rows.dtype == torch.bool:
        return rows
    mask = torch.zeros(n, dtype=torch.bool)
    mask[rows] = True
    return mask


@pytest.mark.parametrize("precision", ["bf16", "bf16-serving", "fp8"])
@pytest.mark.parametrize("heads, head_dim", [(1, 16), (4, 64), (8, 16), (32, 128)])
def test_torch_cpu_score_cells_do_not_depend_on_the_rows_sharing_the_call(precision, heads, head_dim):
    # what lets rows= score the rows asked for alone on the torch backend: every cell of a
    # chunk's call keeps its bits when the row is scored alone, with a few others, or at
    # another position of the call (the pool range fixed, as the global grid fixes it). At
    # H 1 a call of one row takes another matmul path: the backend pads calls to 16 rows
    x = make_inputs([300, 90], heads=heads, head_dim=head_dim, kpool=KPOOL, seed=heads)
    seq = ShardedSequence.split(x.cu_seq_lens, 1, 0)
    config = KPoolConfig(topk=TOPK, kpool=KPOOL, precision=precision, max_logits_bytes=64 * 4 * 200 * heads)
    c = run_gathered(shard_inputs(x, seq), seq, config)
    problem = c.call.problem
    backend = resolve_backend("torch", problem)
    assert backend.scores_row_subsets(torch.device("cpu")) and not backend.scores_row_subsets(torch.device("cuda"))
    g = torch.Generator().manual_seed(heads)
    calls = 0
    for call in chunk_calls(c.plan, c.queries):
        if call.q is None:
            continue
        lo, hi = call.chunk.pool_lo, call.chunk.pool_hi
        whole = backend.score(problem, c.pools, call.q, call.w, lo, hi).scores
        n = call.q.shape[0]
        for pick in (torch.tensor([0]), torch.tensor([n - 1]), torch.randperm(n, generator=g)[: max(1, n // 3)]):
            part = backend.score(problem, c.pools, call.q[pick], call.w[pick], lo, hi).scores
            assert torch.equal(part, whole[pick]), (call.chunk, pick.tolist())
        calls += 1
    assert calls >= 2


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rows_equal_the_full_call_simulated_ranks(layout, world_size):
    x = make_inputs(LENGTHS, heads=4, head_dim=8, kpool=KPOOL, seed=world_size)
    seqs = _seqs(layout, world_size)
    local = [shard_inputs(x, s) for s in seqs]
    k_all, gates_all = torch.cat([d["k"] for d in local]), torch.cat([d["gates"] for d in local])
    for config in (KPoolConfig(topk=TOPK, kpool=KPOOL, max_logits_bytes=SMALL_BUDGET),
                   KPoolConfig(topk=TOPK, kpool=KPOOL, tail="compact", order="score", alignment=8)):  # fmt: skip
        for rank, (s, d) in enumerate(zip(seqs, local)):
            inputs = {**d, "k": k_all, "gates": gates_all}
            full = run_gathered(inputs, s, config).ids
            for as_index in (False, True):
                rows = _rows(s, rank if world_size > 1 else 0, seed=3, as_index=as_index)
                got = run_gathered(inputs, s, config, rows=rows).ids
                mask = _mask(rows, s.shard_size)
                assert torch.equal(got[mask], full[mask]), (layout, world_size, rank, config)
                assert bool((got[~mask] == -1).all())


def test_rows_score_only_the_rows_asked_for():
    # rows in the first and the last chunks of one document: only those rows are scored, each
    # against the pool range of its chunk of the global grid (the full call's)
    n = 2048
    x = make_inputs([n], heads=2, head_dim=8, kpool=KPOOL, seed=0)
    seq = ShardedSequence.split(x.cu_seq_lens, 1, 0)
    inp = shard_inputs(x, seq)
    opts = dict(topk=64, kpool=KPOOL, max_logits_bytes=128 * 600)
    full, part = {}, {}
    ref = kpool_topk(**inp, seq=seq, stats=full, **opts)
    rows = torch.cat([torch.arange(0, 40, 3), torch.arange(n - 300, n, 16)])
    got = kpool_topk(**inp, seq=seq, rows=rows, stats=part, **opts)
    assert torch.equal(got[rows], ref[rows]) and bool((got[torch.arange(100, n - 300)] == -1).all())
    assert part["rows"] == rows.numel() and full["rows"] is None
    assert part["causal_pairs"] == sum((int(r) + 1) // KPOOL for r in rows)
    plan = run_gathered(inp, seq, KPoolConfig(**opts)).plan
    C = plan.rows
    width = {c.first // C: c.pool_hi - c.pool_lo for c in plan.chunks}
    expected = sum(width[int(r) // C] for r in rows)
    assert part["scored_cells"] == expected and expected * 8 < full["scored_cells"]


@pytest.mark.parametrize("rows, text", [
    (torch.zeros(5, dtype=torch.bool), "rows: expected a bool mask of S_local = 154 rows"),
    (torch.tensor([0, 154]), "rows: expected storage rows in [0, 154)"),
    (torch.tensor([0.0]), "rows: expected a bool mask [S_local = 154] or a 1-D integer tensor"),
    ([0, 1], "rows: expected a bool mask [S_local = 154] or a 1-D integer tensor of this rank's storage rows, got list"),
])  # fmt: skip
def test_bad_rows_name_the_argument(rows, text):
    x = make_inputs(LENGTHS, heads=4, head_dim=8, kpool=KPOOL, seed=0)
    seq = ShardedSequence.split(x.cu_seq_lens, 1, 0)
    with pytest.raises((TypeError, ValueError)) as err:
        kpool_topk(**shard_inputs(x, seq), seq=seq, topk=TOPK, kpool=KPOOL, rows=rows)
    assert text in str(err.value), str(err.value)


def _gloo_rows(rank, world_size):
    """Every layout, both gathers and the causal balance: ``rows=`` against the full call."""
    import torch.distributed as dist

    out = []
    x = make_inputs(LENGTHS, heads=4, head_dim=8, kpool=KPOOL, seed=world_size)
    for layout in LAYOUTS:
        seq = layout_seq(CU, rank, world_size, layout, seed=5)
        inp = shard_inputs(x, seq)
        for opts in ({"gather": "keys"}, {"gather": "pools", "balance": "causal"},
                     {"balance": "causal", "max_logits_bytes": SMALL_BUDGET}):  # fmt: skip
            full = kpool_topk(**inp, seq=seq, topk=TOPK, kpool=KPOOL, **opts)
            rows = _rows(seq, rank, seed=7, as_index=rank % 2 == 0)
            stats = {}
            got = kpool_topk(**inp, seq=seq, topk=TOPK, kpool=KPOOL, rows=rows, stats=stats, **opts)
            mask = _mask(rows, seq.shard_size)
            out.append((layout, opts, torch.equal(got[mask], full[mask]) and bool((got[~mask] == -1).all()),
                        stats["balance_applied"]))  # fmt: skip
    dist.barrier()
    return out


@pytest.mark.xdist_group("ranks")
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_rows_equal_the_full_call_on_gloo_ranks(world_size):
    results = run_ranks(_gloo_rows, world_size, timeout=240)
    for rank, reports in enumerate(results):
        for layout, opts, equal, balanced in reports:
            assert equal, (rank, layout, opts)
            assert not balanced  # rows=: the partition is not applied
