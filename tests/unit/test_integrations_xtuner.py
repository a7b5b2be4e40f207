"""``sp_kpool.integrations.xtuner`` against XTuner's torch reference semantics.

XTuner's reference is ``torch_kpool_topk_indices`` of ``xtuner/v1/ops/sparse_mla/kpool.py``
(InternLM/xtuner, read at commits 19aa894c9ca7 and 9b26573cc2bf; the same semantics in both).
XTuner cannot be imported here: the package index has only xtuner 0.2.0 (2025), which has no
``xtuner.v1`` at all (no ``SequenceContext``, no KPool), so its documented semantics are
encoded below in an independent small reference (:func:`xtuner_reference`, written from its
docstrings and tests, not copied):

* pools restart at every document of the **global** ``cu_seq_lens_q`` (XTuner's padding
  document included), ``K`` consecutive tokens each; an incomplete pool is never selectable;
* a query at global position ``t = shard_start + i`` in a document starting at ``c`` sees the
  ``(t - c + 1) // K`` complete pools of its document ending at or before it; score of pool
  ``p`` = ``sum_h relu(q_h . key_p * D^-0.5) * w_h * H^-0.5`` (FP32), pool key =
  ``sum_s softmax_s(gate + ape) * k`` per channel;
* the best ``min(index_topk / K, visible)`` pools, canonicalized (below) and expanded to their
  ``K`` token ids in slots ``[0, index_topk)``; the tail (the ``(t - c + 1) % K`` most recent
  tokens, oldest first) in ``[index_topk, index_topk + K - 1)``; width aligned up; ``[S, 1, W]``
  int32.

XTuner's ``expand_pools_and_tail`` canonicalizes the selection before expanding it: the
selected pool ids are sorted ascending (XTuner's comment: "Top-k order is not semantic, but
changes the sparse attention reduction order. Canonicalize pools before expansion so identical
selections agree across SP sizes"), so the unused ``-1`` slots come first, then the pools by
ascending id; ``index_topk // K`` slots, as XTuner's production selector returns them. The
reference below selects (best first, ties toward the lower id, as any order is erased by the
sort) and then runs :func:`expand_pools_and_tail`, a re-implementation of XTuner's function
from that documented behaviour; the whole tensors are compared. (The sort is described by
the issue that asked for it, quoting XTuner; the two stored versions read here, 19aa894c9ca7
and 9b26573cc2bf, expand in the selector's order, so the canonical order is the newer one.
XTuner's dense torch reference narrows its selection to ``min(index_topk // K, P)`` slots
(``P``: all pools of the sequence): on a sequence with fewer pools than slots its ``-1``
slots then sit partly after the pools; its production path, matched here, always has
``index_topk // K``.)
The layouts are XTuner's own
test layouts (tests/module/... ``test_kpool``/``test_sequence_parallel_indexer``): one odd
document, packed documents, ``[10, 6]`` / ``[53, 75]`` / ``[5, 11]`` on 2 ranks,
``(0, 64), (0, 5, 16, 64), (0, 1, 4, 17, 64)`` on 4 ranks, plus padded odd totals and a rank
with only padding rows, on real gloo ranks with a real ``DeviceMesh``.
"""

from __future__ import annotations

import pytest
import torch

from sp_kpool import ShardedSequence
from sp_kpool.integrations import xtuner
from sp_kpool.testing.dist import run_ranks


class SeqCtx:
    """Stand-in for XTuner's ``SequenceContext`` (same field names; duck-typed by the adapter)."""

    def __init__(self, cu_seq_lens_q, *, rows=None, sequence_parallel_mesh=None, shard_start=0, shard_size=0,
                 num_padding=0):  # fmt: skip
        self.cu_seq_lens_q = torch.as_tensor(cu_seq_lens_q, dtype=torch.int32)
        self.cu_seq_lens_k = self.cu_seq_lens_q
        rows = int(self.cu_seq_lens_q[-1]) if rows is None else rows
        self.input_ids = torch.zeros(1, rows, dtype=torch.long)
        self.max_length_q = self.max_length_k = torch.tensor(int((self.cu_seq_lens_q.diff()).max()))
        self.num_padding = num_padding
        self.sequence_parallel_mesh = sequence_parallel_mesh
        self._shard_start = shard_start
        self._shard_size = shard_size

    @property
    def shard_start(self):
        return self._shard_start


def xtuner_split(lengths, world_size, rank, mesh=None):
    """What XTuner's ``SequenceContext.split`` yields: the total padded to a multiple of W, the
    padding appended to ``cu_seq_lens_q`` as a document, contiguous equal shards."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    total = -(-cu[-1] // world_size) * world_size
    if total > cu[-1]:
        cu.append(total)
    local = total // world_size
    return SeqCtx(cu, rows=local, sequence_parallel_mesh=mesh, shard_start=rank * local, shard_size=local)


def xtuner_pool_index(cu, K):
    """XTuner's ``build_pool_index``: ``[P, K]`` int64, the token of each slot of each pool
    (pools restart at every document; ``-1`` where a document's last pool is incomplete)."""
    rows = []
    for c0, c1 in zip(cu[:-1], cu[1:]):
        for start in range(c0, c1, K):
            rows.append([t if t < c1 else -1 for t in range(start, start + K)])
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, K)


def expand_pools_and_tail(selected_pool_ids, pool_index, cu, shard_start, *, index_topk, index_kpool,
                          always_select_tail, alignment):  # fmt: skip
    """XTuner's ``expand_pools_and_tail`` (its documented behaviour): ``selected_pool_ids``
    ``[S, 1, n]`` (``-1`` unfilled) sorted ascending, expanded to ``[S, n K]`` token ids in
    columns ``[0, n K)``, the tail (the ``(j + 1) % K`` most recent tokens of the document,
    oldest first) in ``[index_topk, index_topk + K - 1)``; ``[S, 1, width]`` int32, ``-1``
    elsewhere."""
    K, T = index_kpool, index_topk
    S = selected_pool_ids.shape[0]
    width = -(-(T + K - 1) // alignment) * alignment
    out = torch.full((S, width), -1, dtype=torch.int32)
    sel = selected_pool_ids.squeeze(1).long().sort(dim=-1).values  # the canonical order: -1 first
    expanded = torch.where((sel >= 0)[..., None], pool_index[sel.clamp(min=0)], -1).reshape(S, -1)
    out[:, : expanded.shape[1]] = expanded.to(torch.int32)
    if always_select_tail:
        for i in range(S):
            t = shard_start + i
            c = max(c for c in cu[:-1] if c <= t)
            n_tail = (t - c + 1) % K
            out[i, T : T + n_tail] = torch.arange(t - n_tail + 1, t + 1, dtype=torch.int32)
    return out.unsqueeze(1)


def xtuner_selected_pools(q, k, gates, weights, ape, cu, shard_start, *, index_head_dim, index_topk, index_kpool):
    """What XTuner's selector hands ``expand_pools_and_tail``: ``[S, 1, index_topk // K]``
    int32 global pool ids (best first; ``-1`` unfilled). A query at global ``t`` in a document
    starting at ``c`` sees the ``(t - c + 1) // K`` complete pools of its document; score of a
    pool = ``sum_h relu(q_h . key * D^-0.5) * w_h * H^-0.5`` (FP32), pool key =
    ``sum_s softmax_s(gate + ape) * k``."""
    K, T, H = index_kpool, index_topk, q.shape[1]
    first_pool = {}  # document start -> its first global pool id
    for c0, c1 in zip(cu[:-1], cu[1:]):
        first_pool[c0] = sum(-(-(b - a) // K) for a, b in zip(cu[:-1], cu[1:]) if b <= c0)
    out = torch.full((q.shape[0], 1, T // K), -1, dtype=torch.int32)
    for i in range(q.shape[0]):
        t = shard_start + i
        c = max(c for c in cu[:-1] if c <= t)
        scores = []
        for p in range((t - c + 1) // K):
            toks = torch.arange(c + p * K, c + (p + 1) * K)
            probs = (gates[toks].float() + ape.float()).softmax(dim=0).to(k.dtype)
            key = (probs * k[toks]).sum(dim=0)
            s = torch.relu((q[i].float() @ key.float()) * index_head_dim**-0.5)
            scores.append(float((s * weights[i].float() * H**-0.5).sum()))
        best = sorted(range(len(scores)), key=lambda p: (-scores[p], p))[: T // K]
        out[i, 0, : len(best)] = torch.tensor([first_pool[c] + p for p in best], dtype=torch.int32)
    return out


def xtuner_reference(q, k, gates, weights, ape, cu, shard_start, *, index_head_dim, index_topk, index_kpool=4,
                     always_select_tail=True, alignment=512):  # fmt: skip
    """XTuner's ``kpool_topk_indices``: select, then :func:`expand_pools_and_tail`. ``k``/``gates``
    cover the whole sequence ``[S_g, D]``; ``q [S, H, D]``, ``weights [S, H]``."""
    cu = [int(c) for c in cu]
    sel = xtuner_selected_pools(q, k, gates, weights, ape, cu, shard_start, index_head_dim=index_head_dim,
                                index_topk=index_topk, index_kpool=index_kpool)  # fmt: skip
    return expand_pools_and_tail(sel, xtuner_pool_index(cu, index_kpool), cu, shard_start, index_topk=index_topk,
                                 index_kpool=index_kpool, always_select_tail=always_select_tail, alignment=alignment)  # fmt: skip


def _inputs(total, H=4, D=8, K=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, total, H, D, generator=g), torch.randn(1, total, D, generator=g),
            torch.randn(1, total, D, generator=g), torch.randn(1, total, H, generator=g),
            torch.randn(K, D, generator=g))  # fmt: skip


def _sets(ids):
    return [set(r.tolist()) - {-1} for r in ids.reshape(ids.shape[0], -1)]


# (documents, index_topk, index_kpool, alignment): XTuner's test layouts and a few more
CASES = [
    ([19], 8, 4, 1),  # one document, not a multiple of K (test_selected_token_sets_match_hf_single_document)
    ([13, 17], 8, 4, 1),  # packed documents (test_packed_selection_matches_per_document_reference)
    ([10, 6], 8, 4, 1),  # SP test layout
    ([53, 75], 16, 4, 64),  # a pool straddling the seam (test_kpool_topk_matches_non_sp, smaller topk)
    ([5, 11], 8, 4, 512),  # the build_pools docstring's seam example, XTuner's default alignment
    ([64], 8, 4, 512),  # (0, 64) of test_sequence_parallel_indexer
    ([5, 11, 48], 8, 4, 512),  # (0, 5, 16, 64)
    ([1, 3, 13, 47], 8, 4, 512),  # (0, 1, 4, 17, 64)
    ([7, 1, 9], 12, 3, 8),  # odd lengths, odd total (padded by split), K = 3
    ([3], 4, 2, 1),  # fewer tokens than ranks: a rank holds only padding
    ([40, 23, 9], 32, 4, 64),  # 8 slots: rows with 0..8 visible pools (fewer visible pools than slots)
    ([70], 48, 4, 1),  # 12 slots, up to 17 visible pools: full rows and partial rows
]


@pytest.mark.parametrize("docs, topk, K, align", CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("tail", [True, False])
def test_world_size_one_equals_xtuner_reference(docs, topk, K, align, tail):
    ctx = xtuner_split(docs, 1, 0)
    total = int(ctx.cu_seq_lens_q[-1])
    q, k, g, w, ape = _inputs(total, K=K, seed=len(docs))
    kw = dict(index_head_dim=8, index_topk=topk, index_kpool=K, always_select_tail=tail, alignment=align)
    ours = xtuner.kpool_topk_indices(q, k, g, w, ape, ctx, query_chunk_size=64, **kw)
    ref = xtuner_reference(q[0], k[0], g[0], w[0], ape, ctx.cu_seq_lens_q, 0, **kw)
    assert ours.dtype == torch.int32 and ours.shape == ref.shape, (ours.shape, ref.shape)
    assert _sets(ours) == _sets(ref)
    assert torch.equal(ours, ref)  # the whole tensor: XTuner's columns


def test_canonical_columns_differ_from_score_order():
    # the order is what the comparison checks: the same selection best first is not XTuner's tensor
    ctx = xtuner_split([40, 23, 9], 1, 0)
    q, k, g, w, ape = _inputs(72, seed=3)
    kw = dict(index_head_dim=8, index_topk=32, alignment=64)
    ref = xtuner_reference(q[0], k[0], g[0], w[0], ape, ctx.cu_seq_lens_q, 0, **kw)
    ours = xtuner.kpool_topk_indices(q, k, g, w, ape, ctx, **kw)
    best_first = xtuner.kpool_topk_indices(q, k, g, w, ape, ctx, order="score", **kw)
    assert torch.equal(ours, ref) and _sets(best_first) == _sets(ref) and not torch.equal(best_first, ref)
    # rows with fewer visible pools than slots: the unused slots first, the last pool ends at index_topk
    row = ours[20, 0]  # document 0, j = 20: 5 visible pools of 8 slots
    assert row[:12].tolist() == [-1] * 12 and row[12:32].tolist() == list(range(20))
    assert row[32:35].tolist() == [20, -1, -1]


def test_reference_can_disagree():
    # the comparison has teeth: a different document split changes the reference's sets
    q, k, g, w, ape = _inputs(30)
    kw = dict(index_head_dim=8, index_topk=8)
    a = xtuner_reference(q[0], k[0], g[0], w[0], ape, [0, 13, 30], 0, **kw)
    b = xtuner.kpool_topk_indices(q, k, g, w, ape, SeqCtx([0, 30]), **kw)
    assert _sets(a) != _sets(b)


def test_from_sequence_context():
    ctx = xtuner_split([7, 1, 9], 1, 0)
    seq = xtuner.from_sequence_context(ctx)
    assert isinstance(seq, ShardedSequence) and seq.layout == "contiguous"
    assert seq.cu_seq_lens.tolist() == [0, 7, 8, 17] and seq.world_size == 1
    assert seq.positions.tolist() == list(range(17))


class _Mesh:  # a DeviceMesh's surface, for the single-process checks
    def __init__(self, size, rank):
        self._size, self._rank, self.ndim = size, rank, 1

    def size(self):
        return self._size

    def get_local_rank(self):
        return self._rank

    def get_group(self):
        return None


def test_from_sequence_context_reads_the_mesh_and_shard():
    ctx = xtuner_split([7, 1, 9], 4, 2, mesh=_Mesh(4, 2))  # 17 -> 20: padding document [17, 20)
    seq = xtuner.from_sequence_context(ctx)
    assert seq.world_size == 4 and seq.rank == 2 and seq.shard_start == 10 and seq.shard_size == 5
    assert seq.cu_seq_lens.tolist() == [0, 7, 8, 17, 20]
    assert seq.num_padding == 0  # XTuner's padding document is a document for its indexer, and here


@pytest.mark.parametrize("mutate, text", [
    (lambda a: a.update(q=a["q"][0]), "q: expected XTuner's [1, S, index_n_heads, index_head_dim]"),
    (lambda a: a.update(k=a["k"][:, :-1]), "k: expected shape [1, 16, 8]"),
    (lambda a: a.update(weights=a["weights"][..., :2]), "weights: expected shape [1, 16, 4]"),
    (lambda a: a.update(gate_scores=a["gate_scores"][0]), "gate_scores: expected XTuner's [1, S, index_head_dim]"),
    (lambda a: a.update(kpool_ape=a["kpool_ape"][:3]), "kpool_ape: expected shape [index_kpool, index_head_dim]"),
    (lambda a: a.update(index_topk=10), "index_topk: expected a multiple of index_kpool = 4"),
    (lambda a: a.update(index_head_dim=16), "index_head_dim: expected q.shape[-1] = 8"),
])  # fmt: skip
def test_bad_input_names_xtuners_argument(mutate, text):
    q, k, g, w, ape = _inputs(16)
    a = dict(q=q, k=k, gate_scores=g, weights=w, kpool_ape=ape, seq_ctx=SeqCtx([0, 9, 16]), index_head_dim=8,
             index_topk=8)  # fmt: skip
    mutate(a)
    with pytest.raises((ValueError, TypeError)) as err:
        xtuner.kpool_topk_indices(**a)
    assert text in str(err.value), str(err.value)


def test_context_without_global_lengths_is_refused():
    q, k, g, w, ape = _inputs(8)
    # a shard's context whose cu_seq_lens_q is local (8 rows of a 16-token sequence on 2 ranks)
    local = SeqCtx([0, 8], rows=8, sequence_parallel_mesh=_Mesh(2, 1), shard_start=8, shard_size=8)
    with pytest.raises(ValueError, match=r"SequenceContext\.cu_seq_lens_q: expected the global document boundaries"):
        xtuner.kpool_topk_indices(q, k, g, w, ape, local, index_head_dim=8, index_topk=8)
    # an unsplit context with a shard's rows
    with pytest.raises(ValueError, match=r"cu_seq_lens_q\[-1\] == sequence-parallel size 1 x local rows 8"):
        xtuner.kpool_topk_indices(q, k, g, w, ape, SeqCtx([0, 16]), index_head_dim=8, index_topk=8)
    wrong_start = SeqCtx([0, 16], rows=8, sequence_parallel_mesh=_Mesh(2, 1), shard_start=0, shard_size=8)
    with pytest.raises(ValueError, match=r"SequenceContext\.shard_start: expected rank 1 x local rows 8 = 8"):
        xtuner.from_sequence_context(wrong_start)

    class NoLengths:
        sequence_parallel_mesh = None

    with pytest.raises(TypeError, match=r"SequenceContext\.cu_seq_lens_q: missing on NoLengths"):
        xtuner.kpool_topk_indices(q, k, g, w, ape, NoLengths(), index_head_dim=8, index_topk=8)


# --- real ranks: a DeviceMesh, the gather over its group -------------------------------------


def _ranks_case(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,))
    report = []
    for docs, topk, K, align in CASES:
        ctx = xtuner_split(docs, world_size, rank, mesh=mesh)
        total = int(ctx.cu_seq_lens_q[-1])
        local = total // world_size
        q, k, g, w, ape = _inputs(total, K=K, seed=len(docs))  # every rank draws the same
        sl = slice(rank * local, (rank + 1) * local)
        kw = dict(index_head_dim=8, index_topk=topk, index_kpool=K, alignment=align)
        ours = xtuner.kpool_topk_indices(q[:, sl], k[:, sl], g[:, sl], w[:, sl], ape, ctx, **kw)
        ref = xtuner_reference(q[0, sl], k[0], g[0], w[0, sl], ape, ctx.cu_seq_lens_q, rank * local, **kw)
        whole = xtuner.kpool_topk_indices(q, k, g, w, ape, SeqCtx(ctx.cu_seq_lens_q), **kw)  # world size 1
        empty = bool((ours[:, 0, :topk] == -1).all())  # no row of this rank selects a pool
        report.append((str(docs), _sets(ours) == _sets(ref), torch.equal(ours, ref), torch.equal(ours, whole[sl]), empty))
    return report


@pytest.mark.xdist_group("ranks")
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_equal_xtuner_reference(world_size):
    results = run_ranks(_ranks_case, world_size, timeout=240)
    for rank, report in enumerate(results):
        for docs, same_sets, same, same_as_world1, _ in report:
            assert same_sets and same and same_as_world1, (world_size, rank, docs, same_sets, same, same_as_world1)
    if world_size == 4:  # a rank whose local queries select no pool ([3] on 4 ranks: one row each)
        assert any(rep[4] for report in results for rep in report)
