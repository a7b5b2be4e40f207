"""Host-to-device copies that never make the host wait for the device."""

from __future__ import annotations

import torch

__all__ = ["to_device", "on_gpu"]


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``; a CPU tensor goes to a CUDA device through a pinned copy without
    blocking. From pageable memory the copy waits for every kernel already queued on the
    stream (measured on the H200 host: the whole of a 20 ms device sleep queued before it),
    so in a model's forward pass the device would run dry while the host queues the rest.
    Torch's caching host allocator keeps the pinned block until the copy that reads it is
    done. Returns ``t`` itself when it is already there."""
    device = torch.device(device)
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t).to(device, non_blocking=True)
    return t.to(device)


def on_gpu(device: torch.device | str) -> bool:
    """Whether tensors on ``device`` take the GPU code paths (the Triton kernels and the CUDA
    selectors): a CUDA device. The one predicate for it, so that a CPU test can run those
    host paths with the kernels in Triton's interpreter (:mod:`sp_kpool.testing.standins`)."""
    return torch.device(device).type == "cuda"
