"""Environment variables read by the library (integers)."""

from __future__ import annotations

import os

__all__ = ["env_int"]


def env_int(name: str, *, minimum: int, expected: str) -> int | None:
    """``int($name)``, or ``None`` when it is unset or blank.

    Raises ``ValueError`` naming the variable, ``expected`` (e.g. ``"a positive integer"``)
    and the value when it is not an integer or is below ``minimum``.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected {expected}, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name}: expected {expected}, got {value}")
    return value
