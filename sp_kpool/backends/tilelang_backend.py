"""``backend="tilelang"``: BF16 modes on Hopper GPUs.

Pools on the GPU (``bf16``: the model arithmetic in one Triton kernel, bitwise equal to the
torch ops of :func:`sp_kpool.pooling.compress_pools_bf16` on the GPU, or those ops when
Triton is missing; ``bf16-serving``: the Triton serving-compression kernel, bitwise equal
to the torch one, or the torch one when Triton is missing), scores with the TileLang
kernel of :mod:`sp_kpool.kernels.tilelang_score` (``-inf`` outside each row's causal
range; the fill of the rest of the chunk is skipped when the Triton selector, which reads
only each row's range, selects), selection by :func:`sp_kpool.selection.select_pools` (on
CUDA the exact Triton selector, no host sync).
"""

from __future__ import annotations

from .._probe import probe
from ..selectors import reads_row_ranges_only
from .base import Backend, ChunkScores, PoolInputs, Problem, Queries, QueryInputs, fold_bf16_weights
from .triton_backend import bf16_gpu_reasons, bf16_pools

__all__ = ["TileLangBackend"]


class TileLangBackend(Backend):
    name = "tilelang"
    precisions = ("bf16", "bf16-serving")
    priority = 20
    max_chunk_rows = 1 << 15
    #: Per-row constant of the balance work model, in (row, pool) scores: fitted
    #: (score + select = a * pairs + b * rows) on two H200 ranks (b / a ~ 5900 at the
    #: 256 MiB budget; ``python -m sp_kpool.bench e2e`` fits it).
    balance_row_cost = 5900

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        from ..kernels.tilelang_score import SUPPORTED_DIMS, SUPPORTED_HEADS

        reasons = super().not_supported_reasons(problem) + bf16_gpu_reasons(problem)
        if problem.heads not in SUPPORTED_HEADS:
            reasons.append(f"H = {problem.heads} not in {list(SUPPORTED_HEADS)}")
        if problem.head_dim not in SUPPORTED_DIMS:
            reasons.append(f"D = {problem.head_dim} not in {list(SUPPORTED_DIMS)}")
        if not reasons:  # import only when everything else fits
            _, why = probe("tilelang")
            if why:
                reasons.append(why)
        return reasons

    def prepare(self, problem: Problem, pools: PoolInputs | None, queries: QueryInputs | None):
        """Pools by :func:`~sp_kpool.backends.triton_backend.bf16_pools` (Triton kernels bitwise
        equal to their torch ops, or those ops without Triton); queries as given."""
        pooled = None if pools is None else bf16_pools(problem, pools)
        return pooled, None if queries is None else Queries(queries.q, queries.w, queries.row)

    def score_bytes_per_cell(self, problem: Problem) -> int:
        return 4  # the FP32 logits; Top-K scratch is [C, k + 8]

    def score(self, problem, pools, q, w, lo, hi, starts, ends) -> ChunkScores:
        from ..kernels.tilelang_score import tilelang_scores

        wq = fold_bf16_weights(w, problem.heads, problem.head_dim)
        # the -inf fill of the whole chunk only where a reader needs it (see ChunkScores.masked)
        clean = not reads_row_ranges_only(problem.topk // problem.kpool, hi - lo, problem.order)
        config = problem.settings.tilelang_config
        return ChunkScores(tilelang_scores(q, wq, pools.keys[lo:hi], starts, ends, clean=clean, config=config),
                           masked=True)  # fmt: skip
