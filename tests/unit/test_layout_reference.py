"""The zigzag layouts' stream positions against the frameworks' own code.

* Megatron-LM: the DSA layout helpers, ``megatron/core/transformer/experimental_attention_variant/
  dsa_layout.py`` of the megatron-core wheel (plain torch; first released in 0.19.0), loaded
  from the wheel at test time without installing Megatron or its dependencies, and the
  non-packed zigzag of ``get_batch_on_this_cp_rank`` (``megatron/core/utils.py``), whose two
  functions are taken from the same wheel's source.
* Transformer Engine: ``tex.thd_get_partitioned_indices`` is a CUDA kernel, so its documented
  partitioning is encoded below (:func:`te_partitioned_indices`) and checked against TE's own
  worked examples.

The wheel and its loader: ``tests/unit/megatron_ref.py``. Without the wheel
(``scripts/reference_wheels.sh`` downloads it) the Megatron tests skip, except under CI
(``SP_KPOOL_CI`` or ``CI`` set), where they fail.
"""

from __future__ import annotations

import bisect

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from megatron_ref import megatron, megatron_cp_batch_split  # the wheel's loader (tests/unit/megatron_ref.py)

from sp_kpool.layouts import stream_layout

WORLD_SIZES = range(1, 9)


# (document lengths): odd lengths, empty documents, documents shorter than 2W, one long one
CASES = [
    [1],
    [7],
    [16],
    [0, 5],
    [5, 0],
    [3, 0, 0, 9],
    [1, 1, 1, 1, 1],
    [2, 3, 5, 7, 11, 13],
    [15, 1, 16, 31],
    [33, 0, 2, 64],
    [100, 1, 0, 17],
    [129],
]


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int64)


def _round_up(n, m):
    return -(-n // m) * m


def _padded_cu(lengths, multiple):
    """cu_seqlens_q_padded of Megatron's packed THD: every document rounded up on its own."""
    return _cu([_round_up(n, multiple) for n in lengths])


# --- Transformer Engine, as documented ------------------------------------------------------


def te_partitioned_indices(cu_seqlens, total_tokens, world_size, rank):
    """``tex.thd_get_partitioned_indices(cu_seqlens, total_tokens, world_size, rank)``: rank's
    ``total_tokens / world_size`` indices into the THD stream whose (padded) sequences end at
    ``cu_seqlens`` (every length a multiple of ``2 * world_size``).

    Written from TE's source, not run: transformer_engine/pytorch/csrc/extensions/attention.cpp
    ``thd_get_partitioned_indices`` (checks; output ``[total_tokens / world_size]``) launches
    ``thd_partition_indices_kernel`` in transformer_engine/common/fused_attn/context_parallel.cu,
    which divides cu_seqlens by world_size and maps local token ``t`` through
    ``thd_partition_src_index``: ``seq = binary_search(t)``, ``L = cu_s[seq+1] - cu_s[seq]``,
    ``i = t - cu_s[seq]``, ``offset = rank if i < L/2 else 2 * (world_size - 1) - rank``,
    ``src = i + cu_s[seq] * world_size + L/2 * offset``: per sequence, chunk ``rank`` then
    chunk ``2W - 1 - rank`` of its ``2W`` chunks, sequence by sequence.
    """
    cu = [int(c) for c in cu_seqlens]
    assert all(c % (2 * world_size) == 0 for c in cu) and total_tokens % (2 * world_size) == 0
    cu_s = [c // world_size for c in cu]
    out = []
    for t in range(total_tokens // world_size):
        # binary_search(t, cu_s, len): the last sequence starting at or before t
        seq = bisect.bisect_right(cu_s, t, 1, len(cu_s) - 1) - 1
        L, i = cu_s[seq + 1] - cu_s[seq], t - cu_s[seq]
        offset = rank if i < L // 2 else 2 * (world_size - 1) - rank
        out.append(i + cu_s[seq] * world_size + L // 2 * offset)
    return torch.tensor(out, dtype=torch.int64)


def test_te_reference_reproduces_te_examples():
    # tests/pytorch/attention/test_cp_utils.py,
    # test_thd_get_partitioned_indices_matches_dual_chunk_expected_indices
    cu = torch.tensor([0, 8, 16])
    assert te_partitioned_indices(cu, 16, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert te_partitioned_indices(cu, 16, 2, 1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    # the docstring example of thd_sequence_order_to_cp_rank_order
    # (transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py):
    # "the same dual-chunk CP partitioning used to split each sequence across ranks", the
    # output concatenating each rank's chunks in rank order
    cu = torch.tensor([0, 8, 16, 24, 40])
    x = torch.cat([torch.arange(8)] * 3 + [torch.arange(16)])
    got = torch.cat([x[te_partitioned_indices(cu, 40, 4, r)] for r in range(4)])
    assert got.tolist() == TE_DOC_CP_RANK_ORDER


TE_DOC_CP_RANK_ORDER = [
    0, 7, 0, 7, 0, 7, 0, 1, 14, 15,  # rank 0
    1, 6, 1, 6, 1, 6, 2, 3, 12, 13,  # rank 1
    2, 5, 2, 5, 2, 5, 4, 5, 10, 11,  # rank 2
    3, 4, 3, 4, 3, 4, 6, 7, 8, 9,  # rank 3
]  # fmt: skip


def test_per_document_layout_reproduces_te_docstring_example():
    lay = stream_layout(torch.tensor([0, 8, 16, 24, 40]), 4, "zigzag-per-document")
    assert lay.padding_docs == ()
    x = torch.cat([torch.arange(8)] * 3 + [torch.arange(16)])
    assert torch.cat([x[p] for p in lay.positions]).tolist() == TE_DOC_CP_RANK_ORDER


# --- the comparisons -------------------------------------------------------------------------


def _check_zigzag(lengths, W, mods):
    lay = stream_layout(_cu(lengths), W, "zigzag")
    total = _round_up(sum(lengths), 2 * W)
    assert int(lay.cu_seq_lens[-1]) == total
    cpu = torch.device("cpu")
    for r in range(W):
        ours = lay.positions[r]
        if mods is not None:
            dsa, split = mods
            ref = dsa.build_zigzag_cp_local_positions(total, W, r, cpu)
            assert torch.equal(ours, ref), f"zigzag {lengths} W={W} rank {r}: ours {ours.tolist()} Megatron {ref.tolist()}"
            # the allgather-CP query positions of the DSA attention (skv == sq * cp_size)
            q, _ = dsa.get_cp_positions_from_layout(total // W, total, W, r, "allgather", cpu)
            assert torch.equal(ours, q)
            ref = megatron_cp_batch_split(split, torch.arange(total), W, r)
            assert torch.equal(ours, ref), f"zigzag {lengths} W={W} rank {r}: get_batch_on_this_cp_rank {ref.tolist()}"
        # non-packed zigzag is TE's THD partitioning of a single sequence
        assert torch.equal(ours, te_partitioned_indices([0, total], total, W, r))
    if mods is not None:
        dsa, _ = mods
        reorder = dsa.build_zigzag_allgather_cp_key_reorder(total // W, W, cpu)
        assert torch.equal(reorder, torch.argsort(torch.cat(lay.positions)))


def _check_per_document(lengths, W, pad_multiple, mods):
    m = pad_multiple or 2 * W
    lay = stream_layout(_cu(lengths), W, "zigzag-per-document", pad_multiple=pad_multiple)
    padded = _padded_cu(lengths, m)
    # the stream, padding documents merged into the document before them, is Megatron's
    # cu_seqlens_q_padded; stream positions are positions in that padded THD stream
    keep = [i for i in range(len(lay.cu_seq_lens)) if i not in lay.padding_docs]  # a padding doc's start
    assert lay.cu_seq_lens[keep].tolist() == padded.tolist(), (lay.cu_seq_lens.tolist(), lay.padding_docs)
    total = int(padded[-1])
    cpu = torch.device("cpu")
    for r in range(W):
        ours = lay.positions[r]
        te = te_partitioned_indices(padded, total, W, r)
        assert torch.equal(ours, te), f"per-document {lengths} W={W} m={m} rank {r}: ours {ours.tolist()} TE {te.tolist()}"
        if mods is not None:
            dsa, _ = mods
            ref = dsa.build_packed_allgather_cp_local_positions(padded, W, r, cpu, cu_seqlens_cover_output=True)
            assert torch.equal(ours, ref), f"per-document {lengths} W={W} m={m} rank {r}: ours {ours.tolist()} Megatron {ref.tolist()}"
    if mods is None:
        return
    dsa, _ = mods
    # the gathered-key reorder of allgather CP (keys gathered rank by rank, back to stream order)
    q, reorder = dsa.build_packed_allgather_cp_query_positions_and_key_reorder(
        padded, padded, W, 0, cpu, query_cu_seqlens_cover_output=True, key_cu_seqlens_cover_output=True
    )
    assert torch.equal(q, lay.positions[0])
    assert torch.equal(reorder, torch.argsort(torch.cat(lay.positions)))
    if W == 1:
        return
    # the fused indexers' segment metadata: per document a front and a back segment, each a
    # chunk of queries whose keys are the document's stream positions up to that chunk's end
    for r in range(W):
        seg = dsa.build_packed_cp_indexer_layout(padded, padded, cp_size=W, cp_rank=r, key_size=total)
        ours = lay.positions[r]
        for s in range(seg.segment_q_lengths.numel()):
            q_lo, q_hi = int(seg.segment_cu_q[s]), int(seg.segment_cu_q[s + 1])
            k_lo, k_hi = int(seg.segment_cu_k[s]), int(seg.segment_cu_k[s + 1])
            if q_hi == q_lo:
                continue
            start = int(seg.segment_key_starts[s])
            assert seg.source_indices[k_lo:k_hi].tolist() == list(range(start, int(ours[q_hi - 1]) + 1))
            assert start == int(padded[s // 2])  # the segment's document


@pytest.mark.parametrize("W", WORLD_SIZES)
@pytest.mark.parametrize("lengths", CASES, ids=lambda c: "-".join(map(str, c)))
def test_zigzag_matches_megatron_and_te(lengths, W):
    _check_zigzag(lengths, W, megatron())


@pytest.mark.parametrize("W", WORLD_SIZES)
@pytest.mark.parametrize("lengths", CASES, ids=lambda c: "-".join(map(str, c)))
def test_per_document_matches_megatron_and_te(lengths, W):
    mods = megatron()
    _check_per_document(lengths, W, None, mods)
    _check_per_document(lengths, W, 2 * W * 3, mods)  # pipelines that pad to a larger multiple


@pytest.mark.parametrize("W", WORLD_SIZES)
@pytest.mark.parametrize("lengths", CASES, ids=lambda c: "-".join(map(str, c)))
def test_per_document_matches_te_without_megatron(lengths, W):
    # the TE comparison runs even where the wheel is missing
    _check_per_document(lengths, W, None, None)
    _check_zigzag(lengths, W, None)


def test_megatron_rejects_what_it_does_not_lay_out():
    # the module is the real one: its checks hold (documents not padded to 2W are refused)
    dsa, _ = megatron()
    with pytest.raises(ValueError):
        dsa.build_zigzag_cp_local_positions(10, 2, 0, torch.device("cpu"))
    with pytest.raises(ValueError):
        dsa.build_packed_allgather_cp_local_positions(torch.tensor([0, 6]), 2, 0, torch.device("cpu"))


def test_property_against_megatron():
    mods = megatron()

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        st.lists(st.integers(0, 40), min_size=1, max_size=7).filter(lambda ls: sum(ls) > 0),
        st.integers(1, 8),
        st.sampled_from([None, 1, 2, 4]),
    )
    def check(lengths, W, factor):
        _check_zigzag(lengths, W, mods)
        _check_per_document(lengths, W, None if factor is None else 2 * W * factor, mods)

    check()
