"""FP8 MQA scoring with DeepGEMM's per-logit arithmetic as a CUDA kernel of our own
(``cuda_fp8_mqa.cu``, with its PTX helpers in ``cuda_fp8_mqa_ptx.cuh``; sm_90a): the first
step of the fused design of issue #27, a warp-specialised scorer whose bits are DeepGEMM's
``fp8_mqa_logits`` and whose schedule is ours (query blocks sharing each pool tile, no
stores), so that its speed can be compared with DeepGEMM's before a gate and candidate
buffer are added to it. The same kernel on BF16 queries and keys computes the ``triton``
backend's BF16 scores (its Triton scorer's arithmetic: BF16 tensor-core dots, the same head
chains, no pool scale).

**Status: experimental.** The ``deepgemm`` and ``triton`` backends score with it only with
``SP_KPOOL_CUDA_SCORER=1`` (:mod:`sp_kpool.backends.cuda_scorer`). Written without a GPU:
``tests/gpu/test_cuda_fp8_mqa.py`` checks it against DeepGEMM (and the Triton kernel in
BF16) bit for bit and ``python -m sp_kpool.bench cuda-scorer`` times it, on a Hopper GPU. On the CPU,
``tests/unit/test_cuda_fp8_mqa_ptx.py`` compiles it for sm_90a and checks its PTX and SASS
against DeepGEMM's template compiled the same way.

Build: at the first :func:`score` call of a process, with the host's ``nvcc``
(``Settings.cuda_home``'s ``bin/nvcc``, from ``CUDA_HOME`` or ``CUDA_PATH``, else ``nvcc`` on
``PATH``, else ``/usr/local/cuda/bin/nvcc``) into ``Settings.cache_path() / "cuda"``
(``SP_KPOOL_CACHE_DIR``, else ``$XDG_CACHE_HOME/sp_kpool``, default ``~/.cache/sp_kpool``:
:mod:`sp_kpool.settings` reads the environment, this module does not), named by a hash of
the sources (the ``.cu`` and the header it includes), the flags and the compiler's version,
so a changed source or compiler builds
again and a built library is reused by later processes. Loaded with :mod:`ctypes`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..settings import Settings, current_settings

__all__ = ["score", "nvcc", "compile_command", "build", "SOURCE", "HEADER", "HEADS", "MODES", "DTYPES"]

#: The kernel's source (package data), the file given to nvcc.
SOURCE = Path(__file__).with_name("cuda_fp8_mqa.cu")
#: The header :data:`SOURCE` includes (``#include "cuda_fp8_mqa_ptx.cuh"``: nvcc finds a quoted
#: include next to the including file, so the command needs no ``-I``); package data too.
HEADER = Path(__file__).with_name("cuda_fp8_mqa_ptx.cuh")
#: Index heads the kernel is compiled for.
HEADS = (32, 64, 128)
#: ``mode`` of :func:`score`, by the kernel's ``MODE`` template argument.
MODES = {"dense": 0, "nostore": 1}
#: Input dtypes, by the kernel's ``DT`` template argument.
DTYPES = {torch.float8_e4m3fn: 0, torch.bfloat16: 1}
#: The one target: wgmma and setmaxnreg need sm_90a (Hopper).
ARCH = "-gencode=arch=compute_90a,code=sm_90a"
FLAGS = ("-std=c++17", "-O3", ARCH)


def nvcc(settings: Settings | None = None) -> str | None:
    """The path of the ``nvcc`` used to build the kernel, or ``None`` when none is found:
    ``settings.cuda_home``'s (default: the process settings) ``bin/nvcc``, else ``nvcc`` on
    ``PATH``, else ``/usr/local/cuda/bin/nvcc`` (looked up once per process and toolkit: the
    backends ask on every call)."""
    return _find_nvcc((settings or current_settings()).cuda_home)


@functools.lru_cache(maxsize=4)
def _find_nvcc(home: str | None) -> str | None:
    for cand in ([os.path.join(home, "bin", "nvcc")] if home else []) + [shutil.which("nvcc") or "",
                                                                           "/usr/local/cuda/bin/nvcc"]:  # fmt: skip
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def compile_command(compiler: str, output: str, *, ptx: bool = False, verbose: bool = False,
                    debug: bool = False) -> list[str]:  # fmt: skip
    """The ``nvcc`` command that builds :data:`SOURCE` into ``output``: the shared library
    (``ptx=False``) or its PTX (``ptx=True``); ``verbose`` adds ptxas' resource report;
    ``debug`` defines ``KPOOL_DEBUG`` (a pipeline wait still open after 1 s by the
    GPU's global timer prints its barrier and traps instead of hanging)."""
    kind = ["-ptx"] if ptx else ["-shared", "-Xcompiler", "-fPIC"]
    extra = (["-Xptxas", "-v"] if verbose else []) + (["-DKPOOL_DEBUG"] if debug else [])
    return [compiler, *FLAGS, *kind, *extra, str(SOURCE), "-o", output]


def build(compiler: str | None = None, *, debug: bool = False, settings: Settings | None = None) -> Path:
    """The path of the built library (``debug``: with ``KPOOL_DEBUG``), building it first
    when the cache (``settings.cache_path() / "cuda"``; default: the process settings) has
    none for this source, these flags and this compiler. Raises ``RuntimeError`` naming
    the reason (no ``nvcc``, or the compiler's own message)."""
    settings = settings or current_settings()
    compiler = compiler or nvcc(settings)
    if compiler is None:
        raise RuntimeError("cuda_fp8_mqa: no nvcc found (set CUDA_HOME, or put nvcc on PATH)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    sources = SOURCE.read_bytes() + HEADER.read_bytes()
    key = hashlib.sha256(sources + repr((FLAGS, debug, version)).encode()).hexdigest()[:16]
    lib = settings.cache_path() / "cuda" / f"cuda_fp8_mqa{'-debug' if debug else ''}-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    print(f"[sp_kpool] building {SOURCE.name} with {compiler} (about 10 s, once per source and compiler)",
          file=sys.stderr, flush=True)  # fmt: skip
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:  # same file system: the rename is atomic
        out = os.path.join(tmp, lib.name)
        done = subprocess.run(compile_command(compiler, out, debug=debug), capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"cuda_fp8_mqa: nvcc failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        os.replace(out, lib)
    print(f"[sp_kpool] built {lib} in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    return lib


@functools.lru_cache(maxsize=2)
def _library(debug: bool = False) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build(debug=debug)))
    fn = lib.kpool_fp8_mqa
    p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    fn.argtypes = [i, i, i, i, p, p, ll, p, p, p, p, p, ll, p, i, i, i, p, ctypes.c_char_p, i]
    fn.restype = i
    return lib


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (q8's), got {t.device}")
    if t.data_ptr() % 16:
        raise ValueError(f"{name}: its data must be 16-byte aligned (the tensor-memory accelerator's rule)")


def score(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor | None, ks: torch.Tensor,
          ke: torch.Tensor, *, mode: str = "dense", q_blocks: int = 1, out: torch.Tensor | None = None,
          grid: int | None = None, debug: bool = False) -> torch.Tensor | None:  # fmt: skip
    """Scores every row of ``q`` against the pools of ``keys`` with DeepGEMM's per-logit
    arithmetic (module doc; the formula is in ``cuda_fp8_mqa.cu``), on the current stream.

    q: ``[S, H, 128]``, contiguous, H in :data:`HEADS`: ``float8_e4m3fn`` (the fp8
        arithmetic) or ``bfloat16`` (the BF16 modes' arithmetic of the ``triton`` backend:
        BF16 tensor-core dots, the same head chains, no pool scale).
    weights: ``[S, H]`` ``float32``, contiguous (the folded head weights).
    keys: ``[P, 128]`` of ``q``'s dtype, unit column stride, row stride a multiple of 16 bytes.
    scales: ``[P]`` ``float32``, contiguous, for E4M3; ``None`` for BF16.
    ks, ke: ``[S]`` ``int32``, contiguous: row ``i`` sees the pools ``[ks[i], ke[i])``.
    mode: ``"dense"`` returns ``out`` (default a new ``[S, P]`` ``float32`` tensor filled with
        ``-inf``) with ``out[i, p]`` the logit of row ``i`` and pool ``p`` for every ``p`` of
        ``[ks[i], ke[i])``; columns outside that range but inside the pool tiles scored for
        the row's task hold the scores of pools the row does not see (DeepGEMM's legacy
        columns), the others are not written. ``"nostore"`` computes every logit and writes
        none (times the scoring alone); returns ``None``.
    q_blocks: query blocks (of ``128 / H`` rows) per task that share each pool tile, 1 or 2.
    out: ``[S, >= P]`` ``float32`` with unit column stride (``mode="dense"``).
    grid: most CTAs (default: the device's multiprocessor count).
    debug: use the library built with ``KPOOL_DEBUG``: a pipeline wait still open after
        1 s prints its barrier, stage and parity and traps (a CUDA error, not a hang).

    Needs a CUDA device of compute capability 9.0 (the kernel is built for sm_90a only).
    Raises ``TypeError``/``ValueError`` naming the argument, ``RuntimeError`` for the build
    or the launch.
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {list(MODES)}, got {mode!r}")
    if q_blocks not in (1, 2):
        raise ValueError(f"q_blocks: expected 1 or 2, got {q_blocks!r}")
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q: expected a tensor [S, H, 128], got {getattr(q, 'shape', type(q).__name__)}")
    if q.dtype not in DTYPES:
        raise TypeError(f"q: expected dtype float8_e4m3fn or bfloat16, got {q.dtype}")
    S, H, D = q.shape
    dev = q.device
    if dev.type != "cuda":
        raise ValueError(f"q: expected a CUDA tensor, got device {dev}")
    if torch.cuda.get_device_capability(dev) != (9, 0):
        raise RuntimeError(f"cuda_fp8_mqa: needs compute capability 9.0 (Hopper), device {dev} has "
                           f"{torch.cuda.get_device_capability(dev)}")  # fmt: skip
    if H not in HEADS or D != 128:
        raise ValueError(f"q: expected H in {list(HEADS)} and 128 channels, got shape {list(q.shape)}")
    if S < 1 or not isinstance(keys, torch.Tensor) or keys.dim() != 2 or keys.shape[0] < 1:
        raise ValueError(f"q, keys: expected at least one row and one pool [P, 128], got {list(q.shape)}, "
                         f"{list(getattr(keys, 'shape', []))}")  # fmt: skip
    P = keys.shape[0]
    _check("q", q, q.dtype, (S, H, 128), dev)
    if not q.is_contiguous():
        raise ValueError("q: expected a contiguous tensor")
    _check("weights", weights, torch.float32, (S, H), dev)
    _check("keys", keys, q.dtype, (P, 128), dev)
    row_bytes = keys.stride(0) * keys.element_size()
    if keys.stride(1) != 1 or row_bytes % 16:
        raise ValueError(f"keys: expected unit column stride and a row stride that is a multiple of 16 bytes, got "
                         f"strides {list(keys.stride())}")  # fmt: skip
    if q.dtype == torch.bfloat16:
        if scales is not None:
            raise ValueError("scales: expected None with BF16 inputs (no pool scale), got a tensor")
    else:
        _check("scales", scales, torch.float32, (P,), dev)
    for name, t in (("ks", ks), ("ke", ke)):
        _check(name, t, torch.int32, (S,), dev)
    for name, t in (("weights", weights), ("scales", scales), ("ks", ks), ("ke", ke)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor")
    sink = None
    if mode == "dense":
        if out is None:
            out = torch.full((S, P), float("-inf"), dtype=torch.float32, device=dev)
        elif out.dtype != torch.float32 or out.dim() != 2 or out.shape[0] != S or out.shape[1] < P or out.stride(1) != 1:
            raise ValueError(f"out: expected float32 [S={S}, >= P={P}] with unit column stride, got {out.dtype} "
                             f"{list(out.shape)} strides {list(out.stride())}")  # fmt: skip
        elif out.device != dev:
            raise ValueError(f"out: expected device {dev}, got {out.device}")
    else:
        sink = torch.zeros(512, dtype=torch.int32, device=dev)
    if grid is None:
        grid = torch.cuda.get_device_properties(dev).multi_processor_count
    err = ctypes.create_string_buffer(1024)
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream(dev).cuda_stream
        rc = _library(debug).kpool_fp8_mqa(
            H, q_blocks, MODES[mode], DTYPES[q.dtype], q.data_ptr(), keys.data_ptr(), row_bytes,
            scales.data_ptr() if scales is not None else None, weights.data_ptr(), ks.data_ptr(), ke.data_ptr(),
            out.data_ptr() if out is not None else None, out.stride(0) if out is not None else 0,
            sink.data_ptr() if sink is not None else None, S, P, int(grid), stream, err, len(err))  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"cuda_fp8_mqa: {err.value.decode(errors='replace')}")
    return out
