"""Timing and output helpers of the benchmark scripts (``scripts/bench*.py``,
``scripts/ncu_select.py``) and the GPU tests (``tests/gpu``).

The scripts are users of the package (``pip install -e .``) and import only public names;
what they share lives here (timing), in :mod:`.bench_inputs` (selector inputs, the
collective) and in :mod:`.bench_report` (reports of ``scripts/bench.py`` runs) rather than
in one script imported by another.

Output and launch options:
  :func:`log`, :func:`save`, :func:`package_versions`, :func:`launch_kwargs`,
  :func:`cpu_model`, :func:`git_commit` (for a record's environment).
Timing (CUDA):
  :func:`median_ms` (CUDA events), :func:`host_ahead_ms` (the host ahead of the device),
  :func:`do_bench_ms` (``triton.testing.do_bench``).
Timing (CPU or CUDA, wall clock): :func:`best_seconds`.

Nothing here is imported by ``import sp_kpool``; triton is imported only by the function
that needs it.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time

import torch

__all__ = ["log", "save", "package_versions", "launch_kwargs", "cpu_model", "git_commit", "median_ms", "host_ahead_ms",
           "do_bench_ms", "best_seconds"]

# ------------------------------------------------------------------------ output


def log(msg) -> None:
    """Print ``msg`` and flush (progress lines of long GPU runs)."""
    print(msg, flush=True)


def save(res, out_dir: str, name: str) -> None:
    """Write ``res`` as ``out_dir/name`` (indented JSON)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(res, f, indent=1)


def package_versions(modules=("triton", "tilelang", "deep_gemm", "lmdeploy")) -> dict:
    """``{module: __version__}`` of the optional packages (``"unavailable (Error)"`` where
    one does not import)."""
    out = {}
    for mod in modules:
        try:
            out[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - a broken build may raise anything
            out[mod] = f"unavailable ({type(exc).__name__})"
    return out


def launch_kwargs(opts) -> dict:
    """``{'name': value}`` of ``['name=value', ...]``: integers where the value is one, else
    the string (``ways=3``, ``tile=1024``)."""
    return {n: int(v) if v.lstrip("-").isdigit() else v for n, v in (o.split("=", 1) for o in opts)}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def git_commit() -> str:
    """``HEAD`` of the checkout this package runs from, ``" (tree modified)"`` appended when
    tracked files differ from it; ``"?"`` outside a git checkout."""
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)  # fmt: skip
        return out.stdout.strip() + (" (tree modified)" if dirty.stdout.strip() else "")
    except Exception:  # noqa: BLE001
        return "?"


# ------------------------------------------------------------------------ timing


def best_seconds(fn, repeat: int = 2, device: torch.device | str = "cpu") -> float:
    """The least wall-clock seconds of ``repeat`` calls of ``fn()`` (the device synchronized
    around each call on CUDA): on a shared CPU the minimum is the run least disturbed."""
    cuda = torch.device(device).type == "cuda"
    best = float("inf")
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def median_ms(fn, reps: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after ``warmup`` runs (CUDA events,
    the device synchronized before the first)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def host_ahead_ms(fn, reps: int = 5) -> tuple[float, float]:
    """``(device ms, host ms)`` medians of ``fn()`` when the host is ahead of the device, as
    in a model's forward pass where earlier layers still run: a ~10 ms device sleep is
    queued before the start event, so the call's host work before its first kernel
    overlaps it. A host time close to the sleep or longer means the call waited for the
    device somewhere."""
    fn()
    torch.cuda.synchronize()
    times, host = [], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(20_000_000)
        a.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2], sorted(host)[len(host) // 2]


def do_bench_ms(fn) -> float:
    """Median milliseconds of ``fn()`` by ``triton.testing.do_bench`` (the measurement of the
    field's kernel benchmarks): calls queued back to back, each after a flush of the L2
    cache, so the host runs ahead of the device and the events time the device's work."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
