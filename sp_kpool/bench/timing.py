"""The timing of the benchmark cases (``python -m sp_kpool.bench``) and the GPU tests
(``tests/gpu``): one home for every way a case times a call.

CUDA: :func:`median_ms` (CUDA events), :func:`host_ahead_ms` (the host ahead of the device),
:func:`do_bench_ms` (``triton.testing.do_bench``), :func:`peak_mb` (peak extra device memory).
CPU or CUDA, wall clock: :func:`best_seconds` (the least of a few calls), :func:`median_seconds`
(the median of synchronized calls). The machine's ceilings measured in the run:
:func:`ceilings`.

Nothing here is imported by ``import sp_kpool``; triton is imported only by the function
that needs it.
"""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["median_ms", "host_ahead_ms", "do_bench_ms", "best_seconds", "median_seconds", "peak_mb", "ceilings"]

# ------------------------------------------------------------------------ timing


def _seconds(fn, cuda: bool) -> float:
    """Wall-clock seconds of one call of ``fn()``, the device synchronized around it on CUDA."""
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def best_seconds(fn, repeat: int = 2, device: torch.device | str = "cpu") -> float:
    """The least wall-clock seconds of ``repeat`` calls of ``fn()`` (the device synchronized
    around each call on CUDA): on a shared CPU the minimum is the run least disturbed."""
    cuda = torch.device(device).type == "cuda"
    return min((_seconds(fn, cuda) for _ in range(repeat)), default=float("inf"))


def median_seconds(fn, device: torch.device | str = "cpu", reps: int = 10, warmup: int = 1) -> float:
    """Median wall-clock seconds of ``reps`` calls of ``fn()`` after ``warmup`` calls, the
    device synchronized around each call on CUDA."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    return statistics.median(_seconds(fn, cuda) for _ in range(reps))


def peak_mb(fn) -> float:
    """MiB of CUDA memory ``fn()`` allocated at its peak above what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


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


def ceilings(device: torch.device, world_size: int = 1, reps: int | None = None) -> dict:
    """This machine's ceilings, measured now: matmul TFLOP/s (FP32, BF16; FP8 on CUDA), copy
    GB/s (read + write) and, with ``world_size > 1`` (a process group initialized), the
    all-gather GB/s received per rank. CUDA: ``n`` 8192, 1 GiB copies, CUDA events
    (:func:`median_ms`, ``reps`` default 10); CPU: ``n`` 1024, 256 MiB, wall clock (3 reps)."""
    cuda = device.type == "cuda"
    reps = reps or (10 if cuda else 3)

    def seconds(fn, r=reps):
        return median_ms(fn, reps=r, warmup=3) / 1e3 if cuda else median_seconds(fn, device, reps=r)

    out: dict = {}
    n = 8192 if cuda else 1024
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(n, n, device=device).to(dt)
        b = torch.randn(n, n, device=device).to(dt)
        out[f"{name}_matmul_tflops"] = 2 * n**3 / seconds(lambda: a @ b) / 1e12  # noqa: B023
    if cuda:
        try:
            a8 = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
            b8 = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
            one = torch.ones((), device=device)
            s = seconds(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
            out["fp8_matmul_tflops"] = 2 * n**3 / s / 1e12
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal
            out["fp8_matmul_tflops"] = f"unavailable: {type(exc).__name__}: {exc}"
    nbytes = (1 << 30) if cuda else (256 << 20)
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out["copy_gbps"] = 2 * nbytes / seconds(lambda: x.clone()) / 1e9  # read + write
    del x
    if world_size > 1:
        import torch.distributed as dist

        from .inputs import gather_into_tensor

        chunk = (64 << 20) if cuda else (16 << 20)
        src = torch.empty(chunk, dtype=torch.uint8, device=device)
        dst = torch.empty(chunk * world_size, dtype=torch.uint8, device=device)
        dist.barrier()
        s = median_seconds(lambda: gather_into_tensor()(dst, src), device, reps=5)
        out["all_gather_recv_gbps"] = (world_size - 1) * chunk / s / 1e9  # bytes received per rank per second
        out["all_gather_chunk_bytes"] = chunk
    if cuda:
        torch.cuda.empty_cache()
    return out
