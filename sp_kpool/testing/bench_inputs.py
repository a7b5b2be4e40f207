"""Inputs and references of the selector benchmarks (``scripts/bench_select.py``,
``scripts/ncu_select.py``, ``tests/gpu``), and the collective the gathers use.

Selector inputs and references:
  :func:`selector_logits` (logits like one scoring chunk of the reference workload),
  :func:`ascending_pools`, :func:`exact_ascending` (the exact Top-K in ascending order).
Communication:
  :func:`gather_into_tensor` (the all-gather collective the package uses).

Nothing here is imported by ``import sp_kpool``.
"""

from __future__ import annotations

import torch

__all__ = ["selector_logits", "ascending_pools", "exact_ascending", "gather_into_tensor"]

# ------------------------------------------------------------- selector inputs


def selector_logits(rows: int, pools: int, levels: int, seed: int, device="cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores [rows, pools] fp32, ends [rows] int32)`` like one scoring chunk of the
    reference workload: row ``r`` visible on ``[0, ends[r])`` with ``ends`` from ``3/4 *
    pools`` to ``pools`` (``-inf`` elsewhere). ``levels`` 0: ``sum_h w_h ReLU(x_h)`` of 8
    heads (smooth, few exact ties); else integers in ``[-levels, levels)`` (heavy ties)."""
    g = torch.Generator(device=device).manual_seed(seed)
    ends = torch.linspace(pools * 3 // 4, pools, rows, device=device).round().int()
    if levels:
        s = torch.randint(-levels, levels, (rows, pools), generator=g, device=device).float()
    else:
        s = torch.zeros(rows, pools, device=device)
        for _ in range(8):
            s += torch.randn(rows, 1, generator=g, device=device) * torch.randn(rows, pools, generator=g, device=device).relu_()
    cols = torch.arange(pools, device=device)
    return s.masked_fill_(cols[None] >= ends[:, None], -float("inf")), ends


def ascending_pools(pools: torch.Tensor) -> torch.Tensor:
    """``pools`` (``-1`` unused) sorted ascending along the last axis, the ``-1`` last: the
    layout of ``topk_ascending``'s output."""
    from ..selection import _ascending

    return _ascending(pools)


def exact_ascending(scores: torch.Tensor, visible: torch.Tensor, k: int, base, block: int = 2048) -> torch.Tensor:
    """The exact Top-K (``selection.topk_pools``: int64 keys, ties to the lower column) of
    each row, ascending, ``-1`` last, int32: the answer ``topk_ascending`` must give.
    Rows in blocks of ``block`` (bounded int64 scratch)."""
    from ..selection import topk_pools

    out = []
    for i in range(0, scores.shape[0], block):
        p, _ = topk_pools(scores[i : i + block], visible[i : i + block], k, base)
        out.append(ascending_pools(p).int())
    return torch.cat(out)


# ----------------------------------------------------------------- communication


def gather_into_tensor():
    """The all-gather collective the package's gathers use: ``dist.all_gather_single``
    (torch >= 2.13) or ``dist.all_gather_into_tensor``; called as ``fn(out, src, group=)``."""
    from ..comm import _gather_into_tensor

    return _gather_into_tensor()
