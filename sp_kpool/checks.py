"""Argument checks shared by the API, the module, the balance, the capture code and the serving references.

Each raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, bad value)
with a message that names the argument, the expected and the actual value.

Integer-like values are accepted wherever an int is: Python ``int``, NumPy integer
scalars and 0-d integer tensors (:func:`check_int`); wherever a list of ints is, also
1-D NumPy integer arrays and integer tensors (:func:`check_int_list`). ``bool`` (Python,
NumPy or tensor) and floats are refused, whatever their value.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = [
    "check_int", "check_int_list", "check_choice", "check_tensor", "check_float_tensor", "check_is_tensor",
    "check_float_dtype", "check_dtype", "check_ndim", "check_dim", "check_device", "check_positive_int",
    "check_power_of_two", "FLOAT_DTYPES",
]  # fmt: skip

#: The floating dtypes :func:`check_float_dtype` accepts by default.
FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _is_bool(value) -> bool:
    return isinstance(value, bool) or isinstance(value, torch.Tensor) and value.dtype == torch.bool


def _as_int(value):
    """``value`` as a Python int if it is integer-like, else ``None``."""
    if _is_bool(value):
        return None
    if isinstance(value, int):
        return int(value)
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype.is_floating_point or value.dtype.is_complex:
            return None
        return int(value.item())
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        kind = getattr(getattr(value, "dtype", None), "kind", None)
        return int(value) if kind in ("i", "u") else None
    return None


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python ``int``: an ``int``, a NumPy integer or a 0-d integer tensor
    (``bool`` and floats are refused: ``TypeError``); ``ValueError`` outside
    ``[minimum, maximum]`` (either bound optional)."""
    number = _as_int(value)
    if number is None:
        raise TypeError(f"{name}: expected int, got {value!r} of type {type(value).__name__}")
    if minimum is not None and number < minimum:
        raise ValueError(f"{name}: expected >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name}: expected <= {maximum}, got {number}")
    return number


def check_int_list(name: str, values) -> list[int]:
    """``values`` as a list of Python ints: a sequence of integer-like values, a 1-D NumPy
    integer array or a 1-D integer tensor (any device). ``TypeError`` for anything else
    (floats and bools included), naming the first bad entry."""
    if isinstance(values, torch.Tensor) or type(values).__module__ == "numpy":
        dtype = values.dtype
        is_int = (not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
                  if isinstance(values, torch.Tensor) else getattr(dtype, "kind", None) in ("i", "u"))  # fmt: skip
        if not is_int:
            raise TypeError(f"{name}: expected integers, got an array of dtype {dtype}")
        if values.ndim != 1:
            raise ValueError(f"{name}: expected a 1-D array, got shape {list(values.shape)}")
        return [int(v) for v in values.tolist()]
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{name}: expected a list of ints, got {type(values).__name__}")
    try:
        items = list(values)
    except TypeError:
        raise TypeError(f"{name}: expected a 1-D integer tensor or a list of ints, got {type(values).__name__}") from None
    out = []
    for i, v in enumerate(items):
        number = _as_int(v)
        if number is None:
            raise TypeError(f"{name}: expected integers, got {name}[{i}] = {v!r} of type {type(v).__name__}")
        out.append(number)
    return out


def check_choice(name: str, value, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")
    return value


def check_tensor(name: str, x, shape: Sequence[int | None], device: torch.device | None = None,
                 device_of: str = "q", why: str | None = None) -> torch.Tensor:  # fmt: skip
    """``x`` if it is a tensor of ``shape`` (entries: an int, exact, or ``None``, any) on
    ``device`` (when given; ``device_of`` names the tensor that set it). ``why``: where the
    expected sizes come from (which argument sets each), shown in the error."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    if x.dim() != len(shape) or any(s is not None and s != a for s, a in zip(shape, x.shape)):
        because = f" ({why})" if why else ""
        raise ValueError(f"{name}: expected shape {want}{because}, got {list(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of {device_of}), got {x.device}")
    return x


def check_float_tensor(name: str, x, shape: Sequence[int | None], device: torch.device | None = None,
                       why: str | None = None) -> torch.Tensor:  # fmt: skip
    """:func:`check_tensor` of a floating-point tensor."""
    if isinstance(x, torch.Tensor) and not x.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating-point dtype, got {x.dtype}")
    return check_tensor(name, x, shape, device, why=why)


# ------------------------------------------------ single-property checks (the serving references)


def check_is_tensor(name: str, t: object) -> torch.Tensor:
    """``t`` if it is a ``torch.Tensor`` (``TypeError`` naming its type otherwise)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def check_float_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...] = FLOAT_DTYPES) -> None:
    """``TypeError`` unless ``t.dtype`` is one of ``allowed`` (default :data:`FLOAT_DTYPES`)."""
    if t.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise TypeError(f"{name}: expected dtype in ({names}), got {t.dtype}")


def check_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """``TypeError`` unless ``t.dtype`` is ``dtype``."""
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")


def check_ndim(name: str, t: torch.Tensor, ndim: int, dims: str) -> None:
    """``ValueError`` unless ``t`` has ``ndim`` dims (``dims`` names them, e.g. ``"[S, D]"``)."""
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims {dims}, got shape {tuple(t.shape)}")


def check_dim(name: str, t: torch.Tensor, axis: int, expected: int, what: str) -> None:
    """``ValueError`` unless ``t.shape[axis] == expected`` (``what`` says where it comes from)."""
    if t.shape[axis] != expected:
        raise ValueError(
            f"{name}: expected size {expected} ({what}) at dim {axis}, got shape {tuple(t.shape)}"
        )


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    """``ValueError`` unless ``t`` is on ``device``."""
    if t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")


def check_positive_int(name: str, value) -> None:
    """``ValueError`` unless ``value`` is a Python ``int`` >= 1 (``bool`` refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


def check_power_of_two(name: str, d: int) -> None:
    """``ValueError`` unless ``d``, the size of ``name``'s last dim, is a power of two."""
    if d < 1 or (d & (d - 1)) != 0:
        raise ValueError(f"{name}: expected the last dim to be a power of two, got {d}")
