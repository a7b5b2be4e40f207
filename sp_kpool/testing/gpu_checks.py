"""Helpers of the GPU tests (``tests/gpu``): the scorers' input cases (:func:`scorer_inputs`,
:func:`scorer_ranges`, :func:`visible`: the Triton kernel's and the CUDA scorer's tests and
the CUDA scorer's smoke run, :mod:`sp_kpool.testing.cuda_smoke`); near-tie comparison of two
selections and the float64 pool scores it needs.

Two implementations of the same arithmetic may select different pools where scores are
within rounding of the selection boundary; :func:`near_tie_rows` accepts those rows and
returns the others.
"""

from __future__ import annotations

import torch

from ..pooling import pool_table
from ..selection import row_meta

__all__ = ["scorer_inputs", "scorer_ranges", "visible", "ids_of", "near_tie_rows", "bf16_row_scores",
           "fp8_row_scores"]  # fmt: skip

#: Input cases of :func:`scorer_inputs`.
CASES = ("random", "ties", "plateau", "nonfinite")


def scorer_inputs(S: int, H: int, P: int, seed: int, case: str, dtype=torch.float8_e4m3fn, device="cuda"):
    """``(q [S, H, 128], w [S, H] fp32, kv [P, 128], scale [P] fp32)`` of a scorer case, ``q``
    and ``kv`` in ``dtype`` (``bfloat16``: ``scale`` is ``None``, the BF16 arithmetic has
    none). Cases: ``random``; ``ties`` (values on a grid of 1/2: many equal logits);
    ``plateau`` (every third row's weights zero, the next third's negative: scores <= 0);
    ``nonfinite`` (NaN, +inf and -inf pool scales, a NaN and an infinite head weight; needs
    ``S >= 5``, ``P >= 301``)."""
    if case not in CASES:
        raise ValueError(f"case: expected one of {list(CASES)}, got {case!r}")
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(S, H, 128, generator=g, device=device)
    kv = torch.randn(P, 128, generator=g, device=device)
    if case == "ties":
        q, kv = torch.round(q * 2) / 2, torch.round(kv * 2) / 2
    w = torch.randn(S, H, generator=g, device=device) * 0.2
    scale = 2.0 ** torch.randint(-4, 4, (P,), generator=g, device=device).float()
    if case == "plateau":
        w[::3] = 0.0
        w[1::3] = w[1::3].abs() * -1  # every score <= 0
    if case == "nonfinite":
        scale[[5, 77, 300]] = torch.tensor([float("nan"), float("inf"), -float("inf")], device=device)
        w[2, 5] = float("nan")
        w[4, 0] = float("inf")
    return q.to(dtype), w, kv.to(dtype), scale if dtype == torch.float8_e4m3fn else None


def scorer_ranges(S: int, P: int, seed: int, odd: bool = False, device="cuda"):
    """``(starts, ends)`` ``[S]`` int32: random pool ranges, the first three rows ``[0, P)``;
    ``odd`` also an empty row (5), a one-pool row whose start is not a multiple of 4 (6) and
    a row of the last three pools (7) (needs ``S >= 8``, ``P >= 8``)."""
    g = torch.Generator(device=device).manual_seed(seed)
    ends = torch.randint(0, P + 1, (S,), generator=g, device=device)
    starts = (ends - torch.randint(0, P + 1, (S,), generator=g, device=device)).clamp(min=0)
    ends[:3] = P
    starts[:3] = 0
    if odd:
        starts[5], ends[5] = 7, 7
        starts[6], ends[6] = 1, 2
        starts[7], ends[7] = P - 3, P
    return starts.int(), ends.int()


def visible(starts: torch.Tensor, ends: torch.Tensor, P: int) -> torch.Tensor:
    """``[S, P]`` bool: whether pool ``p`` lies in row ``i``'s range ``[starts[i], ends[i])``."""
    cols = torch.arange(P, device=starts.device)
    return (cols[None] >= starts[:, None].long()) & (cols[None] < ends[:, None].long())


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

