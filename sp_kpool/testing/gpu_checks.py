"""Helpers of the GPU tests (``tests/gpu``): near-tie comparison of two selections and the
float64 pool scores it needs.

Two implementations of the same arithmetic may select different pools where scores are
within rounding of the selection boundary; :func:`near_tie_rows` accepts those rows and
returns the others.
"""

from __future__ import annotations

import torch

from ..pooling import pool_table
from ..selection import row_meta

__all__ = ["ids_of", "near_tie_rows", "bf16_row_scores", "fp8_row_scores"]


def ids_of(backend: str, problem) -> torch.Tensor:
    """The ids of ``problem`` (a gathered :class:`~sp_kpool.backends.base.Problem`) by the
    backend named ``backend``: the pipeline's stages 3-8 (:func:`sp_kpool.pipeline.solve`)."""
    from ..pipeline import solve

    return solve(problem, backend).ids


def near_tie_rows(problem, out_a: torch.Tensor, out_b: torch.Tensor, row_scores, rel_tol: float = 1e-5):
    """``(rows that differ, global rows beyond a near-tie)``: the rows whose selected token
    sets differ, and those where some swapped pool's float64 score (``row_scores(r, lo,
    hi)`` -> ``[hi - lo]``) lies farther than ``rel_tol * max|s|`` from the selection
    boundary."""
    seq, K = problem.seq, problem.kpool
    diff = torch.nonzero((torch.sort(out_a, dim=1).values != torch.sort(out_b, dim=1).values).any(1)).flatten()
    starts, offs = pool_table(seq.real_cu_seq_lens, K)
    starts = starts.to(out_a.device)
    bad = []
    for r in diff.tolist():
        t = seq.shard_start + r
        m = row_meta(torch.tensor([t]), seq.real_cu_seq_lens, offs, K)
        lo, hi = int(m.pool_lo[0]), int(m.pool_hi[0])
        sc = row_scores(r, lo, hi)
        ranked = torch.sort(sc, descending=True).values
        kk = min(problem.topk // K, hi - lo)
        boundary = float(ranked[kk - 1])
        tol = rel_tol * float(sc.abs().max()) + 1e-9
        to_pool = {int(s): i for i, s in enumerate(starts[lo:hi].tolist())}
        sa = {to_pool[v] for v in out_a[r].tolist() if v in to_pool}
        sb = {to_pool[v] for v in out_b[r].tolist() if v in to_pool}
        if any(abs(float(sc[p]) - boundary) > tol for p in sa ^ sb):
            bad.append(t)
    return diff.numel(), bad


def bf16_row_scores(problem, pooled):
    """``f(r, lo, hi)`` for :class:`~sp_kpool.backends.base.Pools` ``pooled``: float64 scores of row ``r`` against pools ``[lo, hi)`` (BF16
    arithmetic of the reference: ReLU of ``q . k / sqrt(D)``, head weights ``/ sqrt(H)``)."""
    H, D = problem.heads, problem.head_dim
    pk = pooled.keys.double()

    def f(r, lo, hi):
        sc = torch.relu(problem.q[r].double() @ pk[lo:hi].t() * D**-0.5)
        return (problem.head_weights[r].double() * H**-0.5) @ sc

    return f


def fp8_row_scores(q8, wq, k8, ks):
    """``f(r, lo, hi)``: float64 scores of the FP8 arithmetic (dequantized values and scales)."""
    kd, qd = k8.double(), q8.double()

    def f(r, lo, hi):
        return ks[lo:hi].double() * (wq[r].double() @ torch.relu(qd[r] @ kd[lo:hi].t()))

    return f

