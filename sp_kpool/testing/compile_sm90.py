"""Compile the Triton scorer and selector kernels for Hopper (sm_90) without a GPU: what CI
can check of kernel code that only a GPU can run (it compiles; the scorer to ``wgmma`` and no
``mma.sync``).

:func:`scorer_asm` compiles :mod:`sp_kpool.kernels.triton_fp8_fused`'s kernels at the launch
shapes ``score_select`` takes by default (its ``_shape``, ``STAGES``, ``capacity``),
:func:`selector_asm` :mod:`sp_kpool.kernels.triton_topk`'s at ``topk_ascending``'s default
launch (its ``_launch_consts``), with Triton's own compiler and its bundled ``ptxas``;
nothing is launched. Run it in a process
without ``TRITON_INTERPRET`` (the interpreter replaces ``triton.jit``)::

    python -m sp_kpool.testing.compile_sm90 [--quick]   # a JSON line per kernel: wgmma, no mma.sync

Imports Triton.
"""

from __future__ import annotations

import inspect
import json

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ..kernels import triton_fp8_fused as ff
from ..kernels import triton_topk as tk

__all__ = ["scorer_asm", "selector_asm", "CASES", "QUICK", "SELECTOR_CASES", "uses_wgmma_only"]

#: ``(H, dtype, mode)``: every head count of the scorer, FP8 and BF16, in the modes of
#: ``score_select``: ``dense`` (the scorer of the ``triton`` and ``deepgemm`` H 128 backends),
#: ``fused`` (with selection), ``pairs`` (two row blocks per program)
CASES = [(H, dtype, mode) for H in (32, 64, 128) for dtype in ("fp8", "bf16") for mode in ("dense", "fused", "pairs")]

#: One case of each code path (4 rows per program at H 32, 2 at H 64 / 128; scaled FP8 and
#: BF16; each mode): the unit suite's (about 4 s a compile on a CPU)
QUICK = [(32, "fp8", "dense"), (32, "bf16", "dense"), (32, "fp8", "fused"), (32, "bf16", "pairs"),
         (64, "fp8", "dense"), (64, "bf16", "fused"), (128, "bf16", "dense"), (128, "fp8", "pairs")]  # fmt: skip

#: ``(W, k)``: row widths and pools selected of the selector's launches (groups of 8 and 4)
SELECTOR_CASES = [(32768, 512), (32768, 2048)]

_RUNTIME = dict(sq_r="i32", sq_h="i32", W="*fp32", sw_r="i32", Starts="*i32", Ends="*i32", row0="i32", nrows="i32",
                Logits="*fp32", sl_r="i32", Out="*i32", so_r="i32", BufK="*i32", BufI="*i32", Cnt="*i32",
                Emitted="*i32", k="i32", pool_base="i32")  # fmt: skip


def scorer_asm(H: int, dtype: str, mode: str = "dense", k: int = 512) -> dict:
    """The compiled kernel's ``{"ttgir": str, "ptx": str}`` for ``H`` heads, D 128, inputs
    ``dtype`` (``"fp8"``: float8_e4m3fn queries and pools with FP32 scales, ``"bf16"``: BF16
    without), ``mode`` one of ``dense``, ``fused``, ``pairs`` (see :data:`CASES`), ``k`` pools
    selected (``fused``)."""
    one_dot, bq = ff._shape("scorer_asm", H, 128, k, None, None)
    elem = "*fp8e4nv" if dtype == "fp8" else "*bf16"
    torch_dtype = torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16
    types = dict(_RUNTIME, Q=elem, KV=elem, KS="*fp32" if dtype == "fp8" else elem)
    if mode == "pairs":
        kernel = ff._dense_pairs_kernel
        consts = dict(H=H, D=128, BQ=bq, BP=ff.BLOCK_P, SCALED=dtype == "fp8")
    else:
        kernel = ff._fused_kernel
        dense = mode == "dense"
        consts = dict(H=H, D=128, BQ=bq, BP=ff.BLOCK_P, CAP=ff.capacity(k) if not dense else 1024,
                      KP=1 if dense else 1 << max(0, k - 1).bit_length(), DENSE=dense, ONE_DOT=one_dot,
                      CHECK=ff.CHECK, SCAN=dense or ff.SLOTS == "scan", STORE=True, SCALED=dtype == "fp8")  # fmt: skip
    return _compile(kernel, types, consts, dict(num_warps=4, num_stages=ff.STAGES[torch_dtype], enable_fp_fusion=False))


def selector_asm(W: int, k: int, short: bool = False) -> dict:
    """The compiled ``select_kernel`` (``short``: ``short_kernel``) of ``topk_ascending`` at
    its default launch for rows of ``W`` columns and ``k`` pools: ``{"ttgir", "ptx"}``."""
    types = dict(S="*fp32", stride_s="i32", starts_ptr="*i32", ends_ptr="*i32", base_ptr="*i64", Out="*i32",
                 stride_o="i32", Gmax="*i32", Cand="*i32", R="i32", k="i32", nprog="i32")  # fmt: skip
    if short:
        return _compile(tk.short_kernel, types, dict(KP=tk._pow2(k)), dict(num_warps=max(1, min(8, tk._pow2(k) // 128))))
    split2, split4 = tk._check_split("split2", tk._DEFAULT_SPLIT2), tk._check_split("split4", tk._DEFAULT_SPLIT4)
    consts = tk._launch_consts(W, k, None, None, None, None, 3, tk._DEFAULT_VSTEPS, split2, split4, None, True)
    options = {n: consts.pop(n) for n in ("num_warps", "maxnreg") if n in consts}
    return _compile(tk.select_kernel, types, consts, options)


def _compile(kernel, types: dict, consts: dict, options: dict) -> dict:
    """``kernel`` compiled for sm_90: runtime arguments of ``types``, ``consts`` and the
    constexpr defaults of its signature as constants."""
    sig = inspect.signature(kernel.fn).parameters
    params = list(sig)
    consts = {**{n: p.default for n, p in sig.items() if n not in types and p.default is not inspect.Parameter.empty},
              **consts}  # fmt: skip
    signature = {n: types[n] if n in types else "constexpr" for n in params}
    src = ASTSource(fn=kernel, signature=signature, constexprs={(params.index(n),): v for n, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return {"ttgir": compiled.asm["ttgir"], "ptx": compiled.asm["ptx"]}


def uses_wgmma_only(ptx: str) -> bool:
    """Whether ``ptx`` has Hopper's ``wgmma`` and no ``mma.sync`` (the older tensor-core
    instruction a dot may fall back to)."""
    return "wgmma.mma_async" in ptx and "mma.sync" not in ptx.replace("wgmma.mma_async.sync", "")


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the QUICK cases only (default: every case)")
    args = ap.parse_args(argv)
    for H, dtype, mode in QUICK if args.quick else CASES:
        ptx = scorer_asm(H, dtype, mode)["ptx"]
        print(json.dumps({"H": H, "dtype": dtype, "mode": mode, "wgmma_only": uses_wgmma_only(ptx)}), flush=True)
    for W, k in SELECTOR_CASES:
        for short in (False, True):
            ptx = selector_asm(W, k, short)["ptx"]
            print(json.dumps({"selector": "short" if short else "select", "W": W, "k": k, "ptx_lines": ptx.count("\n")}),
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
