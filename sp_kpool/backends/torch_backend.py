"""The torch reference backend: the model-definition arithmetic on CPU or CUDA.

Pools as ``Glm5NextTextIndexer.get_pooled_states`` (FP32 slot softmax, probabilities cast
to the key dtype, weighted sum in the key dtype); scores as its ``forward``: queries and
pooled keys in FP32, ``ReLU(D^-0.5 * q.k)`` per head, then the FP32 head-weighted sum with
``H^-0.5``. Autocast is disabled inside, so an enclosing autocast region changes nothing.
"""

from __future__ import annotations

import torch

from ..pooling import compress_pools_bf16
from .base import Backend, Problem

__all__ = ["TorchBackend"]


class TorchBackend(Backend):
    name = "torch"
    precisions = ("bf16",)
    priority = 0

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        return super().not_supported_reasons(problem)

    def pool(self, problem: Problem, pool_tok_start: torch.Tensor) -> torch.Tensor:
        with torch.autocast(problem.device.type, enabled=False):
            return compress_pools_bf16(problem.k, problem.gates, problem.ape, pool_tok_start)

    def score_bytes_per_cell(self, problem: Problem) -> int:
        # [C, H, N] FP32 per-head scores + [C, N] FP32 logits + [C, N] int64 sort keys.
        return 4 * (problem.heads + 1) + 8

    def score(self, problem: Problem, pooled: torch.Tensor, q: torch.Tensor, w: torch.Tensor, lo: int, hi: int):
        C, H, D = q.shape
        with torch.autocast(q.device.type, enabled=False):
            keys = pooled[lo:hi].float()  # [N, D]
            s = torch.matmul(q.float().reshape(C * H, D), keys.t())  # [C*H, N]
            s = torch.relu_(s.mul_(D**-0.5)).view(C, H, -1)
            wf = (w.float() * H**-0.5).unsqueeze(1)  # [C, 1, H]
            return torch.bmm(wf, s).squeeze(1)  # [C, N]
