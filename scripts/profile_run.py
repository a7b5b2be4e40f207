"""Profile one indexer call on the reference workload (torch.profiler), to see where the
time outside the kernels goes.

    python scripts/profile_run.py --backend tilelang --precision bf16 --heads 64 [--out DIR]

Prints the CUDA-time and CPU-time tables of one call after two warm-up calls and writes a
Chrome trace ``profile_<backend>.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from sp_kpool.backends import BACKENDS  # noqa: E402
from sp_kpool.backends.base import default_max_logits_bytes  # noqa: E402
from sp_kpool.testing.problems import rank_slice_problem  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="tilelang")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--total", type=int, default=131072)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    p = rank_slice_problem(args.total, 4, 3, heads=args.heads, head_dim=128, topk=2048, precision=args.precision,
                           max_logits_bytes=default_max_logits_bytes("cuda"), seed=1)  # fmt: skip
    be = BACKENDS[args.backend]
    for _ in range(2):
        be.run(p)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    be.run(p)
    torch.cuda.synchronize()
    print(f"one call: {(time.perf_counter() - t0) * 1e3:.1f} ms wall", flush=True)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        be.run(p)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    os.makedirs(args.out, exist_ok=True)
    prof.export_chrome_trace(os.path.join(args.out, f"profile_{args.backend}.json"))


if __name__ == "__main__":
    main()
