"""Host-to-device copies that never make the host wait for the device."""

from __future__ import annotations

import torch

__all__ = ["to_device", "on_gpu", "check_device", "device_flag"]


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


def check_device(name: str, text: str, *, auto: bool = False) -> str:
    """``text`` if it names a device this host has: ``cpu``, ``cuda`` or ``cuda:N`` (and
    ``auto``: CUDA when available, else CPU, when ``auto`` is allowed). ``ValueError``
    naming ``name`` (a flag or an argument) otherwise, e.g. ``cuda`` on a host without
    CUDA, before any rank starts or any tensor moves."""
    choices = (["auto"] if auto else []) + ["cpu", "cuda", "cuda:N"]
    if text == "auto" and auto or text == "cpu":
        return text
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type != "cuda":
        raise ValueError(f"{name}: expected one of {choices}, got {text!r}")
    if not torch.cuda.is_available():
        built = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a build without CUDA")
        raise ValueError(f"{name}: expected a device this host has, got {text!r}: CUDA is not available here "
                         f"(torch.cuda.is_available() is False; {built}); use cpu")  # fmt: skip
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"{name}: expected cuda:N with N < {count} (torch.cuda.device_count()), got {text!r}")
    return text


def device_flag(flag: str = "--device", *, auto: bool = False):
    """An argparse ``type=`` for a device flag (:func:`check_device`): argparse then reports
    a bad value as an error of ``flag`` (exit status 2)."""
    import argparse

    def parse(text: str) -> str:
        try:
            return check_device(flag, text, auto=auto)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag}: ")) from None

    return parse
