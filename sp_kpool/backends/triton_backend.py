"""``backend="triton"``: the BF16 modes on Hopper GPUs with Triton alone (no TileLang).

Pools by Triton kernels (``bf16``:
:func:`~sp_kpool.kernels.triton_model_pools.pools_model`, ``bf16-serving``:
:func:`~sp_kpool.kernels.triton_serving.pools_serving`; each bitwise equal to its torch ops
on the GPU, :func:`bf16_pools`, which the ``tilelang`` backend shares). Queries: the BF16
rows as given, the head weights folded once per call
(:func:`~sp_kpool.backends.base.fold_bf16_weights`; the ``tilelang`` backend folds them per
chunk). Scores: the dense mode of
:mod:`sp_kpool.kernels.triton_fp8_fused` on BF16 inputs (:func:`score_triton`): per row,
pool and head one BF16 tensor-core dot over the 128 channels, then DeepGEMM's head chains
without a pool scale (contract §3, §8): the model's score up to FP32 rounding, in an order
fixed by the row, the pool and the heads only (so every sharding gives the same bits), not
the TileLang scorer's order: the ids of the two backends are equal up to near-ties.

H in {32, 64, 128}, D 128, BF16 queries and keys; other shapes run on ``tilelang``. On an
H200 (2026-12-04, the reference slice: 32768 rows x 32768 pools) the scorer takes 14.1-14.2 ms
at H 32 (the rows on the accumulator's lane bits, 00b90ab) and 27.3-28.2 ms at H 64, against
TileLang's 17.4-17.8 and 30.8-31.1 ms (``benchmarks/results/h200-cu130-torch2.11/``).
With ``Settings.cuda_scorer`` (``SP_KPOOL_CUDA_SCORER=1``) the chunks are scored by
:mod:`sp_kpool.kernels.cuda_fp8_mqa` on the BF16 inputs instead: the same arithmetic
(experimental, see :mod:`sp_kpool.backends.cuda_scorer`).
"""

from __future__ import annotations

import torch

from .. import serving
from .._probe import cuda_reason, probe
from ..pooling import compress_pools_bf16
from ..selectors import reads_row_ranges_only
from .base import Backend, ChunkScores, PoolInputs, Pools, Problem, Queries, QueryInputs, fold_bf16_weights
from .cuda_scorer import cuda_scorer_reasons, score_cuda

__all__ = ["TritonBackend", "bf16_pools", "bf16_gpu_reasons", "score_triton"]


def bf16_pools(problem: Problem, pools: PoolInputs) -> Pools:
    """The BF16 modes' pools on the GPU: ``bf16`` (the model arithmetic) by
    :func:`~sp_kpool.kernels.triton_model_pools.pools_model`, ``bf16-serving`` by
    :func:`~sp_kpool.kernels.triton_serving.pools_serving` (with the pools' compression
    order, ``pools.extend``); each is bitwise equal to its torch ops, which run instead when
    Triton is missing (or, in ``bf16``, when the keys are not BF16 or the pool shape is not
    one :func:`~sp_kpool.kernels.triton_model_pools.pools_model_supports`). Returns
    :class:`~sp_kpool.backends.base.Pools` with ``keys`` ``[P, D]`` bfloat16 (``P`` the pools
    of ``pools.pool_tok_start``) and ``scales`` ``None``."""
    args = (pools.k, pools.gates, problem.ape, pools.pool_tok_start)
    triton = probe("triton")[0] is not None
    if problem.precision == "bf16":  # the model definition: one order, no schedule
        if triton and pools.k.dtype == torch.bfloat16:
            from ..kernels.triton_model_pools import pools_model, pools_model_supports

            if pools_model_supports(problem.kpool, problem.head_dim):
                return Pools(pools_model(*args))
        return Pools(compress_pools_bf16(*args))
    if triton:
        from ..kernels.triton_serving import pools_serving

        return Pools(pools_serving(*args, fp8=False, extend=pools.extend))
    return Pools(serving.prepare_pools_bf16_serving(*args, pools.extend))


def bf16_gpu_reasons(problem: Problem) -> list[str]:
    """What the BF16 GPU backends (``triton``, ``tilelang``) need of every call: a CUDA
    device and BF16 queries and keys (empty: both hold)."""
    why = cuda_reason(problem.device)
    reasons = [why] if why else []
    for name, t in (("q", problem.q), ("k", problem.k)):
        if t.dtype != torch.bfloat16:
            reasons.append(f"{name} must be bfloat16, got {t.dtype}")
    return reasons


def score_triton(problem: Problem, q, w, keys, scales, starts, ends, backend: str = "triton") -> ChunkScores:
    """A chunk's logits by the dense mode of :mod:`sp_kpool.kernels.triton_fp8_fused`:
    ``q [C, H, 128]``, ``w [C, H]`` folded FP32 weights, ``keys [n, 128]`` and ``scales [n]``
    (FP8), or BF16 ``q`` and ``keys`` with ``scales=None``; ``starts``/``ends [C]`` int32.
    Returns ``[C, n]`` FP32 scores, column ``c`` the pool ``keys[c]``; cells outside each row's
    range ``-inf`` where a reader needs it, else unwritten (as ``fp8_mqa_logits`` without
    ``clean_logits``). Raises if the logits storage exceeds the call's budget (the message
    names ``backend``)."""
    from ..kernels.triton_fp8_fused import score_select

    n = keys.shape[0]
    clean = not reads_row_ranges_only(problem.topk // problem.kpool, n, problem.order)
    logits = score_select(q, w, keys, scales, starts, ends, 1, dense=True, fill=float("-inf") if clean else None)
    have = logits.untyped_storage().nbytes()
    if have > problem.max_logits_bytes:
        raise RuntimeError(f"{backend}: logits storage {have} bytes exceeds the budget {problem.max_logits_bytes} "
                           f"({q.shape[0]} rows x {n} columns, Triton scorer)")  # fmt: skip
    return ChunkScores(logits, masked=True)


class TritonBackend(Backend):
    name = "triton"
    precisions = ("bf16", "bf16-serving")
    #: above ``tilelang`` (20): the faster scorer of the shapes both take
    priority = 25
    max_chunk_rows = 1 << 15
    #: Per-row constant of the balance work model: ``tilelang``'s fit (5900), not refitted for
    #: this scorer (a constant of the partition only; the ids do not depend on it).
    balance_row_cost = 5900
    #: One dot and one head chain per (row, pool) cell: partial chunks are scored as their rows here.
    row_local_scores = True

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        reasons = super().not_supported_reasons(problem) + bf16_gpu_reasons(problem)
        if not reasons:
            _, why = probe("triton")
            if why:
                reasons.append(why)
            else:  # the scorer's shapes (H, D), from the kernel module (one place for them)
                from ..kernels.triton_fp8_fused import supports

                reasons += supports(problem.heads, problem.head_dim, 1)
        if not reasons and problem.settings.cuda_scorer:
            reasons += cuda_scorer_reasons(problem)
        return reasons

    def prepare(self, problem: Problem, pools: PoolInputs | None, queries: QueryInputs | None):
        """Pools by :func:`bf16_pools`; queries as given with the head weights folded once,
        :func:`~sp_kpool.backends.base.fold_bf16_weights` (``[n, H]`` FP32; zero rows stay
        zero)."""
        pooled = None if pools is None else bf16_pools(problem, pools)
        prepared = None
        if queries is not None:
            prepared = Queries(queries.q, fold_bf16_weights(queries.w, problem.heads, problem.head_dim), queries.row)
        return pooled, prepared

    def score(self, problem, pools, q, w, lo, hi, starts, ends) -> ChunkScores:
        if problem.settings.cuda_scorer:
            return score_cuda(problem, q, w, pools.keys[lo:hi], None, starts, ends, self.name)
        return score_triton(problem, q, w, pools.keys[lo:hi], None, starts, ends)
