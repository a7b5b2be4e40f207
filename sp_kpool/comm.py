"""Collectives over the ``ShardedSequence`` process group.

Only two things cross ranks in the gather-keys path: the keys and gates (all-gathered
before pooling, because a pool may straddle a shard seam) and a tiny validation vector
(so that bad input fails on every rank alike, before any data collective, never hangs).

Shards are equal by construction (``ShardedSequence`` pads), so the even, concatenated
(dim-0) all-gather works on gloo and NCCL alike. The process group is always passed in
explicitly; nothing is kept in module globals except the resolved gather function.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from .sharding import ShardedSequence

__all__ = ["comm_device", "all_gather_rows", "agree_or_raise"]


@functools.lru_cache(maxsize=1)
def _gather_into_tensor():
    """``dist.all_gather_single`` (torch >= 2.13) or ``all_gather_into_tensor`` (older)."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None)
    return fn if fn is not None else dist.all_gather_into_tensor


def comm_device(seq: ShardedSequence) -> torch.device:
    """Device that the group's backend communicates on: CUDA for NCCL, else CPU."""
    import torch.distributed as dist

    backend = str(dist.get_backend(seq.group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_rows(x: torch.Tensor, seq: ShardedSequence) -> torch.Tensor:
    """All-gather equal row shards: ``x_shard [S / R, *F]`` -> ``x [S, *F]`` (rank order).

    With world size 1 the input is returned as is. The result is on ``x.device``.
    """
    if seq.world_size == 1:
        return x
    dev = comm_device(seq)
    src = x.contiguous().to(dev)
    out = torch.empty((seq.world_size * src.shape[0], *src.shape[1:]), dtype=src.dtype, device=dev)
    _gather_into_tensor()(out, src, group=seq.group)
    return out.to(x.device)


def agree_or_raise(
    seq: ShardedSequence, local_error: str | None, signature: Sequence[tuple[str, int]]
) -> None:
    """Fail on every rank alike if any rank saw bad input or ranks disagree.

    Every rank contributes an error flag and a ``signature`` of named integers that must be
    equal everywhere (shapes, options, a hash of ``cu_seq_lens``). One small all-gather
    carries them; only when something is wrong a second, object all-gather carries the
    error texts. Every rank then raises the same ``ValueError``, naming the ranks.
    With world size 1 this raises ``local_error`` directly (no communication).
    """
    if seq.world_size == 1:
        if local_error is not None:
            raise ValueError(local_error)
        return
    import torch.distributed as dist

    dev = comm_device(seq)
    vec = torch.tensor([1 if local_error else 0] + [int(v) for _, v in signature], dtype=torch.int64, device=dev)
    allv = all_gather_rows(vec[None], seq).cpu()  # [world, 1 + n]
    failed = [r for r in range(seq.world_size) if int(allv[r, 0])]
    if failed:
        texts: list = [None] * seq.world_size
        dist.all_gather_object(texts, local_error, group=seq.group)
        lines = [f"rank {r}: {texts[r]}" for r in failed]
        raise ValueError("invalid input on rank(s) %s:\n  %s" % (failed, "\n  ".join(lines)))
    mismatched = []
    for i, (name, _) in enumerate(signature, start=1):
        col = allv[:, i].tolist()
        if any(v != col[0] for v in col):
            mismatched.append(f"{name}: per rank {col}")
    if mismatched:
        raise ValueError(
            "ranks disagree on values that must be equal on every rank:\n  " + "\n  ".join(mismatched)
        )
