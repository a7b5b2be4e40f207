"""Which DeepGEMM is installed and which of its MQA-logits API generations it has, detected once.

Two API generations score the ``fp8`` arithmetic (``backend="deepgemm"``):

* ``fp8_mqa_logits`` (tokenspeed-deepgemm 2.5): ``fn(q8, (k8, k_scale), weights, ks, ke,
  clean_logits=...)``; **legacy** columns (absolute kv columns, guard columns; with
  ``clean_logits`` the kernel writes ``-inf`` outside ``[ks, ke)``) and, where the function
  takes ``max_seqlen_k``, **compact** columns too (request-local columns; past a row's
  length the storage is uninitialised);
* ``fp8_fp4_mqa_logits`` (2.6 and later): ``fn((q8, None), (k8, k_scale), weights, ks, ke,
  clean_logits=..., max_seqlen_k=...)``; compact columns only; ``clean_logits`` asks the
  kernel to clean the columns past each row's length itself (fused cleaning). Whether it
  does is not checked here (no GPU): the backend masks those columns itself either way.

Which package versions import with which torch (the ``[fp8]`` extras, README 'Backends'):
the 2.5 line carries no torch pin and imports with torch 2.11; 2.6.1 and 2.8.0 carry no pin
but are built against a newer torch (they fail to import with 2.11: an undefined
``c10::ValueError`` symbol); 2.8.2.post20261020 pins ``torch==2.14.0``.

:func:`detect` runs once per process (cached); :func:`describe` is what
``python -m sp_kpool info`` prints.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from .._probe import probe

__all__ = ["DeepGemmApi", "detect", "describe", "installed_version", "DISTRIBUTIONS", "GENERATIONS"]

#: The distributions that install the ``deep_gemm`` module, first match wins.
DISTRIBUTIONS = ("tokenspeed-deepgemm", "deep-gemm", "deep_gemm", "sgl-deep-gemm", "deepinfer-gemm")
#: The API generations, by their scoring function's name.
GENERATIONS = ("fp8_mqa_logits", "fp8_fp4_mqa_logits")


@dataclass(frozen=True)
class DeepGemmApi:
    """The installed DeepGEMM's MQA-logits API.

    version: the distribution and version (``"tokenspeed-deepgemm 2.5.0.post20260810"``), or
        the module's ``__version__``, or ``None``.
    generation: one of :data:`GENERATIONS` (the function used).
    function: the scoring function.
    layouts: the column layouts it supports, preferred first: ``("legacy", "compact")``,
        ``("legacy",)`` or ``("compact",)``.
    fused_clean: whether this generation offers cleaning of the compact columns past each
        row's length in the kernel (``fp8_fp4_mqa_logits``'s ``clean_logits``); the backend
        masks them itself either way (module doc).
    """

    version: str | None
    generation: str
    function: Callable[..., Any]
    layouts: tuple[str, ...]
    fused_clean: bool

    def score(self, q8, kv, weights, ks, ke, *, layout: str, clean: bool, max_seqlen_k: int = 0):
        """``[R, N]`` (legacy) or ``[R, max_seqlen_k]`` (compact) FP32 logits, in the call form
        of this generation (``q8 [R, H, D]`` E4M3, ``kv = (k8 [N, D], k_scale [N])``,
        ``weights [R, H]`` FP32, ``ks``/``ke [R]`` int32)."""
        if layout not in self.layouts:
            raise ValueError(f"layout: the installed deep_gemm ({self.generation}) supports {list(self.layouts)}, "
                             f"not {layout!r}")  # fmt: skip
        if self.generation == "fp8_fp4_mqa_logits":
            return self.function((q8, None), kv, weights, ks, ke, clean_logits=clean, max_seqlen_k=max_seqlen_k)
        if layout == "legacy":
            return self.function(q8, kv, weights, ks, ke, clean_logits=clean)
        return self.function(q8, kv, weights, ks, ke, clean_logits=clean, max_seqlen_k=max_seqlen_k)


def installed_version(module: Any = None) -> str | None:
    """``"<distribution> <version>"`` of the installed ``deep_gemm`` (package metadata), else
    the module's ``__version__``, else ``None``."""
    from importlib import metadata

    for dist in DISTRIBUTIONS:
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    v = getattr(module, "__version__", None)
    return f"deep_gemm {v}" if v else None


def _takes(fn, name: str) -> bool:
    """Whether ``fn`` takes the keyword ``name``: its signature, or (a compiled function, or a
    ``*args`` wrapper) its docstring names it."""
    try:
        if name in inspect.signature(fn).parameters:
            return True
    except (TypeError, ValueError):
        pass
    return name in (getattr(fn, "__doc__", "") or "")


def from_module(dg: Any) -> DeepGemmApi:
    """The API of the ``deep_gemm`` module ``dg`` (no cache; :func:`detect` caches).
    ``fp8_mqa_logits`` is preferred where both exist (its legacy columns need no host read
    of the longest row). Raises ``RuntimeError`` when it has neither."""
    version = installed_version(dg) if not getattr(dg, "__sp_kpool_standin__", False) else "stand-in"
    fn = getattr(dg, "fp8_mqa_logits", None)
    if fn is not None:
        layouts = ("legacy", "compact") if _takes(fn, "max_seqlen_k") else ("legacy",)
        return DeepGemmApi(version, "fp8_mqa_logits", fn, layouts, fused_clean=False)
    fn = getattr(dg, "fp8_fp4_mqa_logits", None)
    if fn is not None:
        return DeepGemmApi(version, "fp8_fp4_mqa_logits", fn, ("compact",), fused_clean=True)
    raise RuntimeError(f"deep_gemm ({version or 'unknown version'}) has neither fp8_mqa_logits nor fp8_fp4_mqa_logits")


@functools.lru_cache(maxsize=1)
def detect() -> DeepGemmApi:
    """The installed DeepGEMM's API, detected once per process. Raises ``RuntimeError`` with
    the reason when ``deep_gemm`` does not import or has no MQA-logits function."""
    dg, why = probe("deep_gemm")
    if dg is None:
        raise RuntimeError(why)
    return from_module(dg)


def describe() -> str:
    """One line for ``python -m sp_kpool info``: the version and the API in use, or why none."""
    try:
        api = detect()
    except RuntimeError as exc:
        from importlib import metadata

        installed = next((f"{d} {metadata.version(d)} installed; " for d in DISTRIBUTIONS if _has(d)), "")
        return f"unavailable: {installed}{exc}"
    return (f"{api.version or 'unknown version'}: API {api.generation} ({', '.join(api.layouts)} columns"
            f"{'; the kernel can clean them (fused cleaning)' if api.fused_clean else ''})")  # fmt: skip


def _has(dist: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False
