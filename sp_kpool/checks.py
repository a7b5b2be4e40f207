"""Argument checks shared by the API, the module, the balance and the capture code.

Each raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, bad value)
with a message that names the argument, the expected and the actual value.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["check_int", "check_choice", "check_tensor", "check_float_tensor"]


def check_int(name: str, value, minimum: int | None = None) -> int:
    """``value`` as an int (``bool`` is refused); ``ValueError`` below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected int, got {value!r} of type {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected >= {minimum}, got {value}")
    return value


def check_choice(name: str, value, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")
    return value


def check_tensor(name: str, x, shape: Sequence[int | None], device: torch.device | None = None,
                 device_of: str = "q") -> torch.Tensor:  # fmt: skip
    """``x`` if it is a tensor of ``shape`` (entries: an int, exact, or ``None``, any) on
    ``device`` (when given; ``device_of`` names the tensor that set it)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    if x.dim() != len(shape) or any(s is not None and s != a for s, a in zip(shape, x.shape)):
        raise ValueError(f"{name}: expected shape {want}, got {list(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of {device_of}), got {x.device}")
    return x


def check_float_tensor(name: str, x, shape: Sequence[int | None], device: torch.device | None = None) -> torch.Tensor:
    """:func:`check_tensor` of a floating-point tensor."""
    if isinstance(x, torch.Tensor) and not x.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating-point dtype, got {x.dtype}")
    return check_tensor(name, x, shape, device)
