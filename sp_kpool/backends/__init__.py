"""Backends and their resolution.

Each backend declares the arithmetic it implements (``precisions``) and answers
``not_supported_reasons(problem)``. ``backend="auto"`` walks the backends by priority and
takes the first that can run the problem in the requested arithmetic; it never picks one
with different arithmetic. An explicit backend that cannot run raises with its reasons;
when nothing fits, the error lists every backend's reasons.
"""

from __future__ import annotations

import warnings

from ..registry import BACKENDS, backend_names
from .base import Backend, Problem
from .deepgemm_backend import DeepGemmBackend
from .tilelang_backend import TileLangBackend
from .torch_backend import TorchBackend
from .triton_backend import TritonBackend

__all__ = ["Backend", "Problem", "BACKENDS", "resolve_backend", "backend_names"]

# the registry (sp_kpool.registry, where RunOptions reads the names) filled with the built-in backends
BACKENDS.update((b.name, b) for b in (TorchBackend(), TileLangBackend(), TritonBackend(), DeepGemmBackend()))
_warned: set = set()


def resolve_backend(name: str, problem: Problem) -> Backend:
    """The backend that will run ``problem``; raises ``ValueError`` with reasons if none."""
    if name == "auto":
        reasons = {}
        for b in sorted(BACKENDS.values(), key=lambda b: -b.priority):
            why = b.not_supported_reasons(problem)
            if not why:
                _say_once_what_was_skipped(b, problem, reasons)
                return b
            reasons[b.name] = why
        detail = "\n  ".join(f"{n}: {'; '.join(r)}" for n, r in reasons.items())
        raise ValueError(f"backend: no backend can run this problem:\n  {detail}")
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {backend_names()}, got {name!r}")
    b = BACKENDS[name]
    why = b.not_supported_reasons(problem)
    if why:
        raise ValueError(f"backend: {name!r} cannot run this problem: {'; '.join(why)}")
    return b


def _say_once_what_was_skipped(chosen: Backend, problem: Problem, reasons: dict) -> None:
    """Warn once per process and reason when ``auto`` ran a slower implementation of the
    same arithmetic because a faster one is unavailable on a CUDA device (the numerics
    never change with availability; only the implementation does)."""
    if problem.device.type != "cuda":
        return
    for bname, why in reasons.items():
        b = BACKENDS[bname]
        if problem.precision in b.precisions and b.priority > chosen.priority:
            key = (bname, problem.precision, tuple(why))
            if key not in _warned:
                _warned.add(key)
                warnings.warn(
                    f"sp_kpool: precision {problem.precision!r} runs on backend {chosen.name!r}; "
                    f"the faster {bname!r} is unavailable: {'; '.join(why)}",
                    RuntimeWarning,
                    stacklevel=4,
                )
