"""Inputs of the benchmark cases (``python -m sp_kpool.bench``) and the GPU tests
(``tests/gpu``), and the collective the gathers use.

The reference slices (rank 3 of a 4-rank split, D 128, kpool 4):
  :data:`SLICES` (``W``, ``W262k``, ``packed64``), :func:`slice_problem` (``Wrecency`` too),
  :func:`prepared` (a backend's prepared inputs for a scorer alone, every row in one call).
Selector inputs and references:
  :func:`selector_logits` (logits like one scoring chunk of the reference workload),
  :func:`ascending_pools`, :func:`exact_ascending` (the exact Top-K in ascending order).
Communication:
  :func:`gather_into_tensor` (the all-gather collective the package uses).

Nothing here is imported by ``import sp_kpool``.
"""

from __future__ import annotations

import torch

__all__ = ["SLICES", "slice_problem", "prepared", "selector_logits", "ascending_pools", "exact_ascending", "gather_into_tensor"]

# ------------------------------------------------------------ reference slices

#: The slices' documents: ``name -> (total tokens, document lengths or None for one document)``.
SLICES = {"W": (131072, None), "W262k": (262144, None), "packed64": (131072, [2048] * 64)}


def slice_problem(case: str, H: int, topk: int = 2048, precision: str = "fp8", device="cuda", **kw):
    """Rank 3 of a 4-rank split of the slice ``case`` (:data:`SLICES`, or ``Wrecency``: W with
    every key scaled by ``1 + 3 t / S`` along the sequence, so later pools score higher), at
    ``H`` heads, D 128; ``kw`` to :func:`~sp_kpool.testing.problems.rank_slice_problem`
    (``max_logits_bytes``)."""
    import dataclasses

    from ..testing.problems import rank_slice_problem

    total, lengths = SLICES["W" if case == "Wrecency" else case]
    p = rank_slice_problem(total, 4, 3, heads=H, head_dim=128, topk=topk, precision=precision, lengths=lengths,
                           device=device, **kw)  # fmt: skip
    if case == "Wrecency":
        S = p.k.shape[0]
        ramp = 1 + 3 * torch.arange(S, device=p.k.device, dtype=torch.float32) / S
        p = dataclasses.replace(p, k=(p.k.float() * ramp[:, None]).to(p.k.dtype))
    return p


def prepared(p, backend: str = "deepgemm") -> tuple:
    """The prepared inputs of problem ``p`` for a scorer alone, every row of its slice in one
    call: ``(q, w, keys, scales, starts, ends, lo)`` as ``backend`` prepares them (``deepgemm``:
    rotated FP8 queries, folded weights, FP8 pools and their scales; ``triton``: BF16 queries,
    folded weights, BF16 pools, ``scales`` ``None``), the pools from ``lo`` on (the first
    chunk's first pool) and the rows' ranges relative to ``lo``."""
    from ..backends import BACKENDS
    from ..backends.base import QueryInputs
    from ..plan import plan_chunks
    from ..pooling import pool_table

    be, seq = BACKENDS[backend], p.seq
    lo_row, hi_row = seq.shard_start, min(seq.shard_end, seq.num_real_tokens)
    pts = pool_table(seq.real_cu_seq_lens, p.kpool)[0].to(p.device)
    plan = plan_chunks(seq, p.kpool, hi_row - lo_row, lo_row, hi_row, p.device, cache=False)
    pools = be.pools(p, pts, None)
    _, queries = be.prepare(p, None, QueryInputs(p.q, p.head_weights, lo_row))
    lo = plan.chunks[0].pool_lo
    n = hi_row - lo_row
    scales = None if pools.scales is None else pools.scales[lo:]
    return queries.q[:n], queries.w[:n], pools.keys[lo:], scales, plan.ranges[0, :n], plan.ranges[1, :n], lo


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
