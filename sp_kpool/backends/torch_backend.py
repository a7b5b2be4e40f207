"""The torch backend: every arithmetic mode, exactly, on CPU or CUDA.

* ``bf16`` pools as ``Glm5NextTextIndexer.get_pooled_states`` (FP32 slot softmax,
  probabilities cast to the key dtype, weighted sum in the key dtype);
  ``bf16-serving`` pools with serving's compression (decode order, or extend order for
  the prompt's pools, ``seq.prompt_lens``) stored BF16
  (:func:`sp_kpool.serving.prepare_pools_bf16_serving`). Both score as the model's
  ``forward``: queries and pooled keys in FP32, ``ReLU(D^-0.5 * q.k)`` per head, then the
  FP32 head-weighted sum with ``H^-0.5``.
* ``fp8``: rotated E4M3 pools and queries (:mod:`sp_kpool.serving`) scored by the
  dequantized reference of DeepGEMM's ``fp8_mqa_logits``.

Autocast is disabled inside, so an enclosing autocast region changes nothing.
"""

from __future__ import annotations

import torch

from .. import serving, serving_scores
from ..pooling import compress_pools_bf16
from .base import Backend, ChunkScores, PoolInputs, Pools, Problem, Queries, QueryInputs

__all__ = ["TorchBackend"]


class TorchBackend(Backend):
    name = "torch"
    precisions = ("bf16", "bf16-serving", "fp8")
    priority = 0

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        reasons = super().not_supported_reasons(problem)
        d = problem.head_dim
        if problem.precision == "fp8" and (d < 1 or d & (d - 1)):
            reasons.append(f"fp8 needs a power-of-two head dim for the Hadamard rotation, got D = {d}")
        return reasons

    def prepare(self, problem: Problem, pools: PoolInputs | None, queries: QueryInputs | None):
        """Pools in the call's arithmetic; queries as given (``fp8`` rotates and quantizes
        each chunk's rows in :meth:`score`, a per-row step)."""
        pooled = prepared = None
        with torch.autocast(problem.device.type, enabled=False):
            if pools is not None:
                args = (pools.k, pools.gates, problem.ape, pools.pool_tok_start)
                if problem.precision == "bf16":  # the model definition: one order, no schedule
                    pooled = Pools(compress_pools_bf16(*args))
                elif problem.precision == "bf16-serving":
                    pooled = Pools(serving.prepare_pools_bf16_serving(*args, pools.extend))
                else:
                    pooled = Pools(*serving.prepare_pools_fp8(*args, pools.extend))
            if queries is not None:
                prepared = Queries(queries.q, queries.w, queries.row)
        return pooled, prepared

    def score_bytes_per_cell(self, problem: Problem) -> int:
        if problem.precision == "fp8":
            # FP32 accumulator + one head's FP32 product + logits + int64 sort keys.
            return 4 * 3 + 8
        # [C, H, N] FP32 per-head scores + [C, N] FP32 logits + [C, N] int64 sort keys.
        return 4 * (problem.heads + 1) + 8

    def score(self, problem: Problem, pools: Pools, q, w, lo: int, hi: int, starts=None, ends=None) -> ChunkScores:
        if problem.precision == "fp8":
            q8, wq = serving.prepare_queries_fp8(q, w)
            logits = serving_scores.mqa_logits_fp8_reference(q8, wq, pools.keys[lo:hi], pools.scales[lo:hi],
                                                      chunk_rows=q.shape[0])  # fmt: skip
            return ChunkScores(logits)
        C, H, D = q.shape
        with torch.autocast(q.device.type, enabled=False):
            keys = pools.keys[lo:hi].float()  # [N, D]
            s = torch.matmul(q.float().reshape(C * H, D), keys.t())  # [C*H, N]
            s = torch.relu_(s.mul_(D**-0.5)).view(C, H, -1)
            wf = (w.float() * H**-0.5).unsqueeze(1)  # [C, 1, H]
            return ChunkScores(torch.bmm(wf, s).squeeze(1))  # [C, N]
