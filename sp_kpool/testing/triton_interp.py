"""Run the Triton kernels on CPU with Triton's interpreter (``TRITON_INTERPRET=1``).

Used by the unit tests so that CI (no GPU) checks the kernels' logic. The interpreter of
Triton 3.6 converts loop bounds with ``int(array)`` on 1-element arrays, which NumPy >= 2.4
rejects; :func:`interpreted_module` patches that one conversion, for the interpreter only.

It also teaches the interpreter what the serving kernels of
:mod:`sp_kpool.kernels.triton_serving` need (:func:`_patch_serving_ops`), in this process
only: kernels defined inside a function (their helpers are closure variables, which the
interpreter's source rewrite drops: it re-executes the source against the module's
globals), the two PTX snippets ``mul.rn.f32`` / ``add.rn.f32`` of ``inline_asm_elementwise``
(NumPy FP32 multiply / add: IEEE round to nearest, never contracted into an FMA, the
PTX semantics) and ``libdevice.exp`` (``triton.language.extra.libdevice`` holds stubs that
return ``None`` in the interpreter; the kernels' ``libdevice`` is replaced, in the
rewritten source only, by torch's CPU ``exp`` on FP32: the function that
:mod:`sp_kpool.serving` calls on CPU, so the kernels stay bitwise comparable to it there;
the GPU's ``expf`` itself is not what is checked), and FP32 -> BF16 / E4M3 conversions
that round to nearest even as the GPU's do (the interpreter truncates to BF16), and
``tl.dot`` of BF16 operands (the interpreter multiplied their uint16 storage; here FP32
values, summed in NumPy's order). Anything else behaves as before.
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


#: the PTX snippets of ``inline_asm_elementwise`` the interpreter emulates (NumPy FP32)
_PTX_BINARY = {"mul.rn.f32 $0, $1, $2;": "multiply", "add.rn.f32 $0, $1, $2;": "add"}


class _Results(list):
    """What ``inline_asm_elementwise`` reads its results from (``.get_result(i)``)."""

    def get_result(self, i):
        return self[i]


def _patch_serving_ops():
    """Closure-defined kernels, ``mul.rn.f32`` / ``add.rn.f32``, ``libdevice.exp`` and
    rounding FP32 -> BF16 / E4M3 conversions in the interpreter (see the module
    docstring); idempotent."""
    import numpy as np
    import torch
    import triton.runtime.interpreter as interp

    if getattr(interp, "_sp_kpool_serving_ops", False):
        return
    builder = interp.interpreter_builder
    inline_orig = builder.create_inline_asm
    stub = importlib.import_module("triton.language.extra.libdevice")  # stubs: the backend supplies them

    class libdevice:  # noqa: N801 - stands where the kernels' `libdevice` stood
        """The libdevice functions the kernels call, on the interpreter's NumPy tensors."""

        @staticmethod
        def exp(x):
            data = np.ascontiguousarray(x.handle.data, dtype=np.float32)
            if x.dtype != interp.tl.float32:
                raise NotImplementedError(f"libdevice.exp of {x.dtype} in the interpreter")
            return interp.tl.tensor(interp.TensorHandle(torch.from_numpy(data).exp().numpy(), x.dtype), x.type)

    def create_inline_asm(inlineAsm, constraints, values, type, isPure, pack):
        op = _PTX_BINARY.get(" ".join(inlineAsm.split()))
        if op is None or len(values) != 2 or pack != 1:
            return inline_orig(inlineAsm, constraints, values, type, isPure, pack)
        a, b = (np.asarray(v.data, dtype=np.float32) for v in values)
        return _Results([interp.TensorHandle(getattr(np, op)(a, b, dtype=np.float32), values[0].dtype.scalar)])

    builder.create_inline_asm = create_inline_asm

    # FP32 -> BF16 / E4M3 as the GPU converts them (round to nearest even; the kernels clamp
    # to +-448 before E4M3): torch's CPU conversions, which round so. The interpreter's own
    # conversion truncates to BF16 (no rounding mode on `.to`) and rounds E4M3 half up.
    torch_of = {interp.tl.float32: torch.float32, interp.tl.bfloat16: torch.bfloat16,
                interp.tl.float8e4nv: torch.float8_e4m3fn}  # fmt: skip
    storage = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}

    def torch_cast(src, dst_type):
        a, b = torch_of.get(src.dtype.scalar), torch_of.get(dst_type.scalar)
        if a is None or b is None or a == b:
            return None
        x = torch.from_numpy(np.ascontiguousarray(src.data)).view(a)
        y = x.to(b).view(storage[b]).numpy().view(interp._get_np_dtype(dst_type.scalar))
        return interp.TensorHandle(y, dst_type.scalar)

    cast_orig, fp_to_fp_orig = type(builder).cast_impl, type(builder).create_fp_to_fp

    def cast_impl(self, src, dst_type):
        out = torch_cast(src, dst_type)
        return out if out is not None else cast_orig(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        out = torch_cast(src, dst_type)
        return out if out is not None else fp_to_fp_orig(self, src, dst_type, rounding_mode)

    type(builder).cast_impl = cast_impl
    type(builder).create_fp_to_fp = create_fp_to_fp

    # tl.dot of BF16 operands: the interpreter stores BF16 as uint16 and multiplies those
    # integers; widen them to FP32 first (the products are exact; the sum is NumPy's FP32
    # matmul, not the tensor core's order)
    dot_orig = type(builder).create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if interp.tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar):
            return dot_orig(self, a, b, d, input_precision, max_num_imprecise_acc)
        wide = [(np.ascontiguousarray(x.data).astype(np.uint32) << 16).view(np.float32)
                if x.dtype.scalar == interp.tl.bfloat16 else np.asarray(x.data, dtype=np.float32) for x in (a, b)]
        return interp.TensorHandle(np.matmul(wide[0], wide[1], dtype=np.float32) + d.data, d.dtype.scalar)

    type(builder).create_dot = create_dot

    rewriter = interp.FunctionRewriter
    exec_orig = rewriter._compile_and_exec

    def _compile_and_exec(self, transformed_ast):
        fn = self.fn
        free = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
        if not free and not any(v is stub for v in fn.__globals__.values()):
            return exec_orig(self, transformed_ast)
        # as the original: the interpreter's names into the module's globals (its `tl` checks
        # read them); the rewritten source sees those plus the closure's values (a copy)
        for key, value in vars(interp).items():
            fn.__globals__.setdefault(key, value)
        scope = dict(fn.__globals__)
        scope.update(free)
        scope.update((n, libdevice) for n, v in list(scope.items()) if v is stub)
        local_namespace = {**self.kwargs}
        exec(compile(transformed_ast, filename=self.filename, mode="exec"), scope, local_namespace)
        return local_namespace[fn.__name__]

    rewriter._compile_and_exec = _compile_and_exec
    interp._sp_kpool_serving_ops = True


def interpreted_module(name: str):
    """Import (or re-import) the kernel module ``name`` with ``TRITON_INTERPRET=1``.

    Triton must not have been imported before in this process without the variable (its
    own library functions, e.g. ``tl.sum``, are then compiled-mode only): set
    ``TRITON_INTERPRET=1`` before the first ``import triton``.
    """
    os.environ["TRITON_INTERPRET"] = "1"
    _patch_index()
    _patch_serving_ops()
    import triton.language.standard as standard
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if not isinstance(standard.sum, InterpretedFunction):
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set; set it before the first import of triton")
    mod = importlib.import_module(name)
    # a module first imported without the interpreter holds compiled-mode kernels and
    # @triton.jit helpers: reload it, after the modules its kernels and helpers come from,
    # each after those its own come from (sp_kpool.kernels.triton_topk launches the kernels
    # of sp_kpool.kernels.triton_topk_kernels, which call those of triton_topk_search)
    compiled = [v for v in vars(mod).values() if isinstance(v, JITFunction)]
    if compiled:
        for dep in _jit_sources(mod, JITFunction, set()):
            importlib.reload(importlib.import_module(dep))
        mod = importlib.reload(mod)
    return mod


def _jit_sources(mod, jit_type, seen: set) -> list[str]:
    """The modules whose ``@triton.jit`` functions ``mod`` holds (``jit_type``: compiled
    mode), each after the modules its own come from: the order to reload them in."""
    order = []
    for dep in sorted({v.fn.__module__ for v in vars(mod).values() if isinstance(v, jit_type)} - {mod.__name__}):
        if dep not in seen:
            seen.add(dep)
            order += _jit_sources(importlib.import_module(dep), jit_type, seen)
            order.append(dep)
    return order
