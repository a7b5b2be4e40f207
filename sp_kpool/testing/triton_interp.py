"""Run the Triton kernels on CPU with Triton's interpreter (``TRITON_INTERPRET=1``).

Used by the unit tests so that CI (no GPU) checks the kernels' logic. The interpreter of
Triton 3.6 converts loop bounds with ``int(array)`` on 1-element arrays, which NumPy >= 2.4
rejects; :func:`interpreted_module` patches that one conversion, for the interpreter only.
"""

from __future__ import annotations

import importlib
import os

__all__ = ["interpreted_module"]


def _patch_index():
    import numpy as np
    import triton.runtime.interpreter as interp

    try:
        int(np.array([1]))
        return  # this NumPy still converts 1-element arrays
    except TypeError:
        pass
    if getattr(interp, "_sp_kpool_patched", False) or not hasattr(interp, "_patch_lang_tensor"):
        return
    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    interp._sp_kpool_patched = True


def interpreted_module(name: str):
    """Import (or re-import) the kernel module ``name`` with ``TRITON_INTERPRET=1``.

    Triton must not have been imported before in this process without the variable (its
    own library functions, e.g. ``tl.sum``, are then compiled-mode only): set
    ``TRITON_INTERPRET=1`` before the first ``import triton``.
    """
    os.environ["TRITON_INTERPRET"] = "1"
    _patch_index()
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if not isinstance(standard.sum, InterpretedFunction):
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set; set it before the first import of triton")
    mod = importlib.import_module(name)
    # a module first imported without the interpreter holds compiled-mode kernels and
    # @triton.jit helpers: reload it, after the modules its helpers come from
    # (sp_kpool.kernels.triton_topk calls those of sp_kpool.kernels.triton_topk_search)
    compiled = [v for v in vars(mod).values() if isinstance(v, JITFunction)]
    if compiled:
        for dep in sorted({v.fn.__module__ for v in compiled} - {name}):
            importlib.reload(importlib.import_module(dep))
        mod = importlib.reload(mod)
    return mod
