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
from ..plan import pad_rows
from ..pooling import compress_pools_bf16
from .base import Backend, ChunkScores, PoolInputs, Pools, Problem, Queries, QueryInputs

__all__ = ["TorchBackend", "MIN_CALL_ROWS"]

#: Fewest query rows of one scoring call (fewer are padded with zero rows): see
#: :meth:`TorchBackend.scores_row_subsets`.
MIN_CALL_ROWS = 16


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

    def scores_row_subsets(self, device: torch.device) -> bool:
        """On the CPU: a call of at least :data:`MIN_CALL_ROWS` rows (fewer are padded with
        zero rows) gives every cell the bits it has in any other call of the same pool range,
        whichever rows share it and wherever the row sits (PyTorch's CPU matmul computes each
        cell of such a call in one order; calls of fewer than about 8 matrix rows take
        another path; ``tests/unit/test_row_subset.py`` checks it). The head sum's bits
        depend on the pool range, which the chunks of the global grid fix. On CUDA, cuBLAS
        chooses its kernel by the call's shape: no."""
        return device.type == "cpu"

    def score(self, problem: Problem, pools: Pools, q, w, lo: int, hi: int, starts=None, ends=None) -> ChunkScores:
        n = q.shape[0]
        if n < MIN_CALL_ROWS:  # the same matmul path for every call (scores_row_subsets)
            q, w = pad_rows(q, 0, MIN_CALL_ROWS - n), pad_rows(w, 0, MIN_CALL_ROWS - n)
        if problem.precision == "fp8":
            q8, wq = serving.prepare_queries_fp8(q, w)
            logits = serving_scores.mqa_logits_fp8_reference(q8, wq, pools.keys[lo:hi], pools.scales[lo:hi],
                                                      chunk_rows=q.shape[0])  # fmt: skip
            return ChunkScores(logits[:n])
        C, H, D = q.shape
        with torch.autocast(q.device.type, enabled=False):
            keys = pools.keys[lo:hi].float()  # [N, D]
            s = torch.matmul(q.float().reshape(C * H, D), keys.t())  # [C*H, N]
            s = torch.relu_(s.mul_(D**-0.5)).view(C, H, -1)
            wf = (w.float() * H**-0.5).unsqueeze(1)  # [C, 1, H]
            return ChunkScores(torch.bmm(wf, s).squeeze(1)[:n])  # [C, N]
