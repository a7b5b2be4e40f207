"""FP32 products and sums rounded to nearest and never contracted into an FMA, for Triton
kernels that equal separate torch kernels bit for bit (:mod:`sp_kpool.kernels.triton_serving`,
:mod:`sp_kpool.kernels.triton_model_pools`): PTX ``mul.rn.f32`` / ``add.rn.f32``.

Imports Triton: import this module only where Triton is available (those modules import it
inside the function that defines their kernels).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["mul_rn", "add_rn"]


@triton.jit
def mul_rn(a, b):
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def add_rn(a, b):
    return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1)
