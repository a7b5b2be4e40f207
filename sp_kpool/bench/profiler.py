"""Profile one indexer call on the reference workload (torch.profiler), to see where the
time outside the kernels goes.

    python -m sp_kpool.bench profile --backend tilelang --precision bf16 --heads 64 [--out DIR]

Prints the CUDA-time and CPU-time tables of one call after two warm-up calls, the call's
GPU timeline (when the first kernel starts after the call begins, the kernels in order, and
every GPU gap of more than 20 us with the kernels around it), and writes a Chrome trace
``profile_<backend>.json`` under ``--out``.
"""

from __future__ import annotations

import json
import os
import time

import torch

from ..backends import BACKENDS
from ..pipeline import solve
from ..testing.problems import reference_slice_problem
from .record import parse_call, parser, require_cuda


def main(argv=None) -> int:
    ap = parser("profile", __doc__)
    ap.add_argument("--out", default=".")
    args = parse_call(ap, argv, "tilelang", "bf16", 64)
    require_cuda("profile")
    p = reference_slice_problem(args.heads, args.precision, total=args.total, seed=1)
    be = BACKENDS[args.backend]
    for _ in range(2):
        solve(p, be.name)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    solve(p, be.name)
    torch.cuda.synchronize()
    print(f"one call: {(time.perf_counter() - t0) * 1e3:.1f} ms wall", flush=True)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        with torch.profiler.record_function("indexer_call"):
            solve(p, be.name)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"profile_{args.backend}.json")
    prof.export_chrome_trace(path)
    timeline(path)
    return 0


def timeline(path, min_gap_us=20.0):
    """Print the GPU timeline of the ``indexer_call`` range of a Chrome trace."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    call = next(e for e in events if e.get("name") == "indexer_call" and e.get("ph") == "X")
    t0, t1 = float(call["ts"]), float(call["ts"]) + float(call["dur"])
    gpu = sorted((float(e["ts"]), float(e["dur"]), e["name"]) for e in events
                 if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))  # fmt: skip
    gpu = [g for g in gpu if t0 <= g[0] <= t1 + 1e6]
    if not gpu:
        print("no GPU activity in the call")
        return
    busy = sum(d for _, d, _ in gpu)
    end = max(s + d for s, d, _ in gpu)
    print(f"\ncall (host) {t1 - t0:.0f} us; first GPU op at +{gpu[0][0] - t0:.0f} us; last GPU op ends at "
          f"+{end - t0:.0f} us; GPU busy {busy:.0f} us in {len(gpu)} ops")  # fmt: skip
    print(f"{'start_us':>9} {'dur_us':>8} {'gap_us':>7}  name")
    prev_end = gpu[0][0]
    for s, d, name in gpu:
        gap = s - prev_end
        if d >= 50 or gap >= min_gap_us:
            print(f"{s - t0:9.0f} {d:8.0f} {gap:7.0f}  {name[:90]}")
        prev_end = max(prev_end, s + d)

