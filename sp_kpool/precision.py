"""The arithmetic switch: ``"bf16"`` (model definition), ``"bf16-serving"``, ``"fp8"``.

=================  ===========================================  =====================
precision          pools                                        key norm, head gate
=================  ===========================================  =====================
``bf16``           FP32 slot softmax, weighted sum in key dtype  module dtype
``bf16-serving``   serving decode compression (FP32), BF16       FP32, autocast off
``fp8``            decode compression, BF16, Hadamard, BF16,     FP32, autocast off
                   E4M3 with UE8M0 scales; queries rotated and
                   quantized, scales folded into head weights
=================  ===========================================  =====================

The default is ``$SP_KPOOL_PRECISION`` (else ``bf16``), read **once** per process, at the
first call that needs it: workers must be restarted to change it, and the rollout engine
must be configured to the same arithmetic. A missing GPU package never changes the
precision; it only changes which implementation runs.
"""

from __future__ import annotations

import functools
import os

__all__ = ["PRECISIONS", "default_precision", "resolve_precision", "SERVING_PRECISIONS"]

PRECISIONS = ("bf16", "bf16-serving", "fp8")
#: Modes whose preparation (key norm, head gate) runs in FP32 with autocast disabled.
SERVING_PRECISIONS = ("bf16-serving", "fp8")
_ENV = "SP_KPOOL_PRECISION"


@functools.lru_cache(maxsize=1)
def default_precision() -> str:
    """``$SP_KPOOL_PRECISION`` or ``"bf16"``; read once, then cached for the process."""
    value = os.environ.get(_ENV, "").strip() or "bf16"
    if value not in PRECISIONS:
        raise ValueError(f"{_ENV}: expected one of {list(PRECISIONS)}, got {value!r}")
    return value


def resolve_precision(precision: str | None) -> str:
    """``precision`` itself if given (validated), else the process default."""
    if precision is None:
        return default_precision()
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {list(PRECISIONS)}, got {precision!r}")
    return precision
