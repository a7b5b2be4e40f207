"""Causal row metadata, and the public names of selection and expansion in one place.

Causal rule (contract §4), for the query at document-local position ``j`` of a document whose
first pool has global id ``pool_lo``::

    visible pools   [pool_lo, pool_lo + (j + 1) // K)     (complete pools ending <= j)
    tail tokens     [t - (j + 1) % K + 1, t]              (ascending, includes t if any)

    K = 4, j = 6:   tokens  0 1 2 3 | 4 5 6
                    pools   [  0  ]   tail = 4 5 6

This module holds the per-row metadata (:class:`RowMeta`, :func:`row_meta`). The exact
Top-K rule is in :mod:`sp_kpool.topk_rule`, the selectors and their registry in
:mod:`sp_kpool.selectors`, expansion, tail and column layouts in :mod:`sp_kpool.expansion`;
their public names are re-exported here.
Everything is index arithmetic on tensors; it runs on CPU and CUDA with no per-row host
synchronisation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ._device import to_device
from .config import ORDERS, TAILS, output_width
from .expansion import assemble
from .selectors import reads_row_ranges_only, select_pools
from .topk_rule import (
    FAST_EXTRA,
    _ascending,
    _rank_by_score,
    score_keys,
    serving_pools,
    topk_pools,
    topk_pools_fast,
    topk_pools_radix,
)

__all__ = [
    "RowMeta",
    "row_meta",
    "output_width",
    "score_keys",
    "topk_pools",
    "topk_pools_fast",
    "select_pools",
    "topk_pools_radix",
    "serving_pools",
    "reads_row_ranges_only",
    "assemble",
    "FAST_EXTRA",
    "TAILS",
    "ORDERS",
]

_ = (_ascending, _rank_by_score)  # private helpers some tests and benchmarks import from here


@dataclass(frozen=True)
class RowMeta:
    """Per-row causal metadata for ``R`` global rows (all tensors ``[R]``, int64).

    rows: global token id ``t``; pool_lo: global id of the document's first pool;
    n_visible: ``(j + 1) // K`` complete visible pools; tail_len: ``(j + 1) % K``;
    padding: bool, rows of the padding document (their output is all ``-1``).
    """

    rows: torch.Tensor
    pool_lo: torch.Tensor
    n_visible: torch.Tensor
    tail_len: torch.Tensor
    padding: torch.Tensor

    @functools.cached_property
    def pool_hi(self) -> torch.Tensor:
        """End (exclusive) of the visible pool range, ``pool_lo + n_visible`` (computed once
        per object: the plan keeps its rows' metadata across calls)."""
        return self.pool_lo + self.n_visible


def row_meta(
    rows: torch.Tensor, real_cu_seq_lens: torch.Tensor, doc_pool_offset: torch.Tensor, kpool: int
) -> RowMeta:
    """Causal metadata of the global ``rows`` (``[R]`` int64) of a packed sequence.

    ``real_cu_seq_lens`` (``[num_docs + 1]``) and ``doc_pool_offset`` (from
    :func:`sp_kpool.pooling.pool_table`) describe real documents only; rows at or past
    ``real_cu_seq_lens[-1]`` are padding. Tables on the host are copied without blocking
    (:func:`sp_kpool._device.to_device`); in loops pass them already on the device.
    """
    device = rows.device
    cu = to_device(real_cu_seq_lens, device)
    offs = to_device(doc_pool_offset, device)
    num_real = cu[-1]
    padding = rows >= num_real
    safe = torch.where(padding, torch.zeros_like(rows), rows)
    doc = torch.searchsorted(cu, safe, right=True) - 1
    j = safe - cu[doc]
    n_visible = torch.where(padding, torch.zeros_like(j), (j + 1) // kpool)
    tail_len = torch.where(padding, torch.zeros_like(j), (j + 1) % kpool)
    return RowMeta(rows=rows, pool_lo=offs[doc], n_visible=n_visible, tail_len=tail_len, padding=padding)
