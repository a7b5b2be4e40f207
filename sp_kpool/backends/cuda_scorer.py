"""The CUDA scorer as the dense scorer of the ``deepgemm`` (FP8) and ``triton`` (BF16) backends,
with ``Settings.cuda_scorer`` (``SP_KPOOL_CUDA_SCORER=1``).

:mod:`sp_kpool.kernels.cuda_fp8_mqa` computes the same arithmetic as the scorer each backend
uses otherwise (DeepGEMM's ``fp8_mqa_logits``; the Triton kernel's BF16 dense mode), so the
logits and the ids are the same bit for bit; only the schedule differs. **Experimental:**
written without a GPU (2026-12-04); ``tests/gpu/test_cuda_fp8_mqa.py`` checks the bits and
``python -m sp_kpool.bench cuda-scorer`` the speed on a Hopper GPU, and until they have run, the
setting is off by default and nothing chooses it.
"""

from __future__ import annotations

import functools

import torch

from ..selectors import reads_row_ranges_only
from .base import ChunkScores, Problem

__all__ = ["cuda_scorer_reasons", "score_cuda", "Q_BLOCKS"]

#: Query blocks per pool tile of the calls made here (``cuda_fp8_mqa.score(q_blocks=)``): 2,
#: each pool tile brought to shared memory serves twice the rows (design C of issue #27);
#: not yet measured against 1.
Q_BLOCKS = 2


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    """The compute capability of CUDA device ``index``, asked once per process."""
    return torch.cuda.get_device_capability(index)


def cuda_scorer_reasons(problem: Problem) -> list[str]:
    """Why the CUDA scorer cannot score ``problem`` (empty: it can), besides the backend's
    own device checks: compute capability 9.0 on a CUDA device, H in 32/64/128, D 128, and
    an ``nvcc`` to build it with."""
    from ..kernels import cuda_fp8_mqa

    reasons = []
    dev = problem.device
    if dev is not None and getattr(dev, "type", None) == "cuda" and _capability(dev.index or 0) != (9, 0):
        reasons.append(f"SP_KPOOL_CUDA_SCORER: the CUDA scorer is built for sm_90a (Hopper), device {dev} has "
                       f"{_capability(dev.index or 0)}")  # fmt: skip
    if problem.heads not in cuda_fp8_mqa.HEADS or problem.head_dim != 128:
        reasons.append(f"SP_KPOOL_CUDA_SCORER: the CUDA scorer takes H in {list(cuda_fp8_mqa.HEADS)} and D 128, "
                       f"got H {problem.heads}, D {problem.head_dim}")  # fmt: skip
    if cuda_fp8_mqa.nvcc() is None:
        reasons.append("SP_KPOOL_CUDA_SCORER: no nvcc to build the CUDA scorer with (CUDA_HOME, PATH)")
    return reasons


def score_cuda(problem: Problem, q, w, keys, scales, starts, ends, backend: str) -> ChunkScores:
    """A chunk's logits by the CUDA scorer: ``q [C, H, 128]`` E4M3 with ``scales [n]`` FP32,
    or BF16 with ``scales=None``; ``w [C, H]`` folded FP32 weights; ``keys [n, 128]``;
    ``starts``/``ends [C]`` int32. Returns ``[C, n]`` FP32 scores, column ``c`` the pool
    ``keys[c]``; cells outside each row's range hold what the kernel left there, marked
    ``masked`` only where the reader reads the ranges alone (otherwise the pipeline masks
    them, as for the torch backend). Raises if the logits would exceed the call's budget
    (the message names ``backend``)."""
    from ..kernels import cuda_fp8_mqa

    C, n = q.shape[0], keys.shape[0]
    need = C * n * 4
    if need > problem.max_logits_bytes:
        raise RuntimeError(f"{backend}: logits storage {need} bytes exceeds the budget {problem.max_logits_bytes} "
                           f"({C} rows x {n} columns, CUDA scorer)")  # fmt: skip
    if scales is not None and scales.data_ptr() % 16:
        scales = scales.clone()  # the kernel's bulk copies read 16-byte aligned scales (a small copy)
    starts, ends = starts.to(torch.int32).contiguous(), ends.to(torch.int32).contiguous()
    out = torch.empty((C, n), dtype=torch.float32, device=q.device)
    cuda_fp8_mqa.score(q.contiguous(), w.contiguous(), keys, scales, starts, ends, q_blocks=Q_BLOCKS, out=out)
    return ChunkScores(out, masked=reads_row_ranges_only(problem.topk // problem.kpool, n, problem.order))
