"""Lazy, cached probes of optional GPU packages. Nothing is imported at ``import sp_kpool``."""

from __future__ import annotations

import functools
import importlib

__all__ = ["probe", "cuda_reason"]

#: package -> the extra that installs it
_EXTRAS = {
    "tilelang": "pip install 'sp-kpool[tilelang]'",
    "triton": "pip install triton (ships with CUDA builds of torch)",
    "deep_gemm": "pip install 'sp-kpool[fp8]' (tokenspeed-deepgemm 2.5, torch 2.11) or 'sp-kpool[fp8-torch214]' "
                 "(2.8.2, torch 2.14.0)",
    "lmdeploy.pytorch.kernels.cuda.sparse_index_topk": "pip install 'sp-kpool[serving]' (lmdeploy)",
}


@functools.lru_cache(maxsize=None)
def probe(module: str) -> tuple[object | None, str | None]:
    """``(module, None)`` if ``module`` imports, else ``(None, reason)``; cached per process."""
    try:
        return importlib.import_module(module), None
    except Exception as exc:  # ImportError, or a broken build raising anything at import
        hint = _EXTRAS.get(module, "")
        return None, f"{module} not importable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]}){'; ' + hint if hint else ''}"


def cuda_reason(device) -> str | None:
    """Why a CUDA kernel cannot run on ``device`` (``None``: it can)."""
    if device.type != "cuda":
        return f"needs a CUDA device, inputs are on {device}"
    if device.index is None:
        import torch

        if not torch.cuda.is_available():
            return "CUDA is not available"
        return _cuda_device_reason(torch.cuda.current_device())
    return _cuda_device_reason(device.index)


@functools.lru_cache(maxsize=None)
def _cuda_device_reason(index: int) -> str | None:
    """:func:`cuda_reason` of CUDA device ``index``, asked once per process and device (every
    call resolves its backend)."""
    import torch

    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, _ = torch.cuda.get_device_capability(index)
    if major < 9:
        return f"needs compute capability >= 9.0 (Hopper), device has {major}.x"
    return None
