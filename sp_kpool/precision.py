"""The arithmetic switch: ``"bf16"`` (model definition), ``"bf16-serving"``, ``"fp8"``.

=================  ===========================================  =====================
precision          pools                                        key norm, head gate
=================  ===========================================  =====================
``bf16``           FP32 slot softmax, weighted sum in key dtype  module dtype
``bf16-serving``   serving compression (FP32; decode or extend   FP32, autocast off;
                   order per pool), BF16                        head gate kept FP32
``fp8``            serving compression, BF16, Hadamard, BF16,    as ``bf16-serving``
                   E4M3 with UE8M0 scales; queries rotated and
                   quantized, scales folded into head weights
=================  ===========================================  =====================

The default is ``Settings.precision`` (``$SP_KPOOL_PRECISION``, else ``bf16``), read
**once** per process (:mod:`sp_kpool.settings`): workers must be restarted to change it,
and the rollout engine must be configured to the same arithmetic. A missing GPU package
never changes the precision; it only changes which implementation runs.
"""

from __future__ import annotations

from .checks import check_choice
from .settings import PRECISIONS, current_settings

__all__ = ["PRECISIONS", "default_precision", "resolve_precision", "SERVING_PRECISIONS"]

#: Modes whose preparation (key norm, head gate) runs in FP32 with autocast disabled.
SERVING_PRECISIONS = ("bf16-serving", "fp8")


def default_precision() -> str:
    """The process default (``Settings.precision``, read once; ``ValueError`` if the
    environment could not be read)."""
    settings = current_settings()
    settings.check()
    return settings.precision


def resolve_precision(precision: str | None, settings=None) -> str:
    """``precision`` itself if given (validated), else the default of ``settings`` (the
    process settings when ``None``)."""
    if precision is None:
        settings = settings or current_settings()
        settings.check()  # a variable that could not be read: say so rather than use a default
        return settings.precision
    return check_choice("precision", precision, PRECISIONS)
