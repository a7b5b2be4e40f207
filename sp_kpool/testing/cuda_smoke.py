"""The CUDA scorer's smoke run (:mod:`sp_kpool.kernels.cuda_fp8_mqa`): one variant on small
inputs with the debug build, one line, so that a stuck or broken variant costs one process.

    python -m sp_kpool.testing.cuda_smoke --list               # every variant's name, one a line
    python -m sp_kpool.testing.cuda_smoke --build              # the release and debug libraries
    python -m sp_kpool.testing.cuda_smoke h32-qb1-dense-fp8    # one variant: one line

A variant is ``h{H}-qb{q_blocks}-{mode}-{dtype}``: H of ``HEADS``, one or two query blocks
per pool tile, ``dense`` or ``nostore``, ``fp8`` (E4M3) or ``bf16``. The run: the library
built with ``KPOOL_DEBUG`` (a pipeline wait still open after 1 s prints its barrier and
traps), 67 rows with odd ranges (:func:`~sp_kpool.testing.gpu_checks.scorer_ranges`) against
517 pools, launched on the device's full grid and on two CTAs (each then runs about 4 to 34
tasks and 16 to 58 pool tiles, counted on ranges of the same distribution drawn on a CPU: the
pipeline's stages wrap two to fifteen times, both barrier parities waited on), each launch
synchronised. ``dense``: the in-range logits of both
launches equal the Triton kernel's dense mode bit for bit (in FP8 DeepGEMM's bits:
``tests/gpu/test_fused_fp8.py``); ``nostore``: both launches run to the end.

The line: ``cuda_smoke VARIANT: STATUS DETAIL (SECONDS s)``, STATUS one of ``pass``, ``fail``
(a logit differs), ``trap`` (the CUDA error of a trap: the debug build's deadline on a stuck
wait prints the barrier on the process's stdout first), ``cuda-error`` (another CUDA error,
e.g. an illegal address) or ``error`` (anything else, e.g. the build); the exit status is 0
for ``pass`` only. A hang prints no line: the caller's time limit names it
(``scripts/gpu_evidence.sh cudasmoke``). ``tests/gpu/test_cuda_fp8_mqa.py`` runs the same
function for every variant in one pytest process.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ..kernels import cuda_fp8_mqa as cu
from .gpu_checks import scorer_inputs, scorer_ranges, visible

__all__ = ["VARIANTS", "parse", "run", "build", "main"]

DTYPE_NAMES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}
#: every variant's name, as :func:`parse` reads it
VARIANTS = tuple(f"h{h}-qb{q}-{mode}-{dt}" for h in cu.HEADS for q in (1, 2) for mode in cu.MODES for dt in DTYPE_NAMES)
S, P = 67, 517  # a row count and a pool count that are not multiples of any tile
SMALL_GRID = 2  # CTAs of the second launch


def parse(variant: str) -> tuple[int, int, str, torch.dtype]:
    """``(H, q_blocks, mode, dtype)`` of a variant's name; ``ValueError`` naming the known ones."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {', '.join(VARIANTS)}; got {variant!r}")
    h, q, mode, dt = variant.split("-")
    return int(h[1:]), int(q[2:]), mode, DTYPE_NAMES[dt]


def run(variant: str) -> tuple[str, str]:
    """``(status, detail)`` of one variant's smoke run (module doc)."""
    H, q_blocks, mode, dtype = parse(variant)
    try:
        q, w, k, scale = scorer_inputs(S, H, P, seed=1, case="random", dtype=dtype)
        starts, ends = scorer_ranges(S, P, seed=2, odd=True)
        outs = []
        for grid in (None, SMALL_GRID):
            outs.append(cu.score(q, w, k, scale, starts, ends, mode=mode, q_blocks=q_blocks, grid=grid, debug=True))
            torch.cuda.synchronize()
        if mode == "nostore":
            return "pass", f"both launches (grid: the device's, {SMALL_GRID}) ran to the end"
        from ..kernels import triton_fp8_fused as ff

        ref = ff.score_select(q, w, k, scale, starts, ends, 64, dense=True)
        vis = visible(starts, ends, P)
        want = ref[vis].view(torch.int32)
        bad = [int((got[vis].view(torch.int32) != want).sum()) for got in outs]
        if any(bad):
            return "fail", f"{bad[0]} and {bad[1]} of {want.numel()} logits differ from the Triton kernel's (grid: " \
                           f"the device's, {SMALL_GRID})"  # fmt: skip
        return "pass", f"{want.numel()} logits of each launch equal the Triton kernel's (grid: the device's, " \
                       f"{SMALL_GRID})"  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the line names what went wrong
        msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:500]
        if "CUDA error" not in msg and "AcceleratorError" not in msg:
            return "error", msg
        trap = any(s in msg.lower() for s in ("unspecified launch failure", "illegal instruction", "trap"))
        return ("trap" if trap else "cuda-error"), msg


def build() -> None:
    """Builds (or finds in the cache) the release and the debug library, printing the device,
    the compiler and each library's path with its seconds: the first step of a GPU session,
    so that the smoke runs' time limits count no compilation."""
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    print(f"device: {name}; torch {torch.__version__}, CUDA {torch.version.cuda}; nvcc {cu.nvcc()}", flush=True)
    for debug in (False, True):
        t0 = time.monotonic()
        print(f"{'debug' if debug else 'release'} library: {cu.build(debug=debug)} ({time.monotonic() - t0:.1f} s)",
              flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variant", nargs="?", help="one of --list")
    ap.add_argument("--list", action="store_true", help="print every variant's name, one a line")
    ap.add_argument("--build", action="store_true", help="build the release and the debug library")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(VARIANTS))
        return 0
    if args.build:
        build()
        return 0
    if args.variant is None:
        ap.error("name a variant (--list prints them)")
    try:
        parse(args.variant)  # a wrong name is a usage error, not a smoke result
    except ValueError as exc:
        ap.error(str(exc))
    t0 = time.monotonic()
    status, detail = run(args.variant)
    print(f"cuda_smoke {args.variant}: {status} {detail} ({time.monotonic() - t0:.1f} s)", flush=True)
    return 0 if status == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
