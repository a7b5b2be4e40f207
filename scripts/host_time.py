"""Host time of one indexer call while the device is busy (does the call ever wait for it?).

    python scripts/host_time.py [--backend deepgemm --precision fp8 --heads 32]

A model's forward pass queues layer after layer ahead of the device; a call that makes the
host wait for the device (a copy from pageable memory, a ``.item()``) leaves the device idle
while the host queues the rest. This script queues a ~20 ms device sleep, then times on the
host the steps of the pipeline (the plan: host arithmetic and one copy; the backend's
``prepare`` of the pools and the queries, one launch for deepgemm) and a whole call
(stages 3-8, ``sp_kpool.pipeline.solve``) on the reference workload (rank 3 of 4 x 32768
tokens, D 128, topk 2048). A step that takes about as long as the sleep waited for the
device. The plan is timed building its tables (the sequence's table cache is cleared
first); the whole call that follows finds them cached, as every layer after the first does.

Runs with the package installed (``pip install -e .`` from the repository root).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from sp_kpool.backends import BACKENDS
from sp_kpool.backends.base import PoolInputs, QueryInputs
from sp_kpool.pipeline import num_pools, solve
from sp_kpool.plan import plan_chunks
from sp_kpool.testing.problems import reference_slice_problem


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="deepgemm")
    ap.add_argument("--precision", default="fp8")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--total", type=int, default=131072)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    p = reference_slice_problem(args.heads, args.precision, total=args.total, seed=args.heads)
    be = BACKENDS[args.backend]
    solve(p, args.backend)
    torch.cuda.synchronize()
    lo, hi = p.seq.shard_start, min(p.seq.shard_end, p.seq.num_real_tokens)
    steps = ("plan", "prepare", "whole_call", "then_synchronize")
    rows = []
    for _ in range(args.reps):
        torch.cuda._sleep(40_000_000)  # ~20 ms on an H200
        t = [time.perf_counter()]
        p.seq.tables.clear()
        plan = plan_chunks(p.seq, p.kpool, be.chunk_rows(p, num_pools(p.seq, p.kpool)), lo, hi, p.device,
                           row_local=be.row_local_scores)  # fmt: skip
        t.append(time.perf_counter())
        before, after = plan.padding()
        be.prepare(p, PoolInputs(p.k, p.gates, plan.pool_tok_start),
                   QueryInputs(p.q[: hi - lo], p.head_weights[: hi - lo], lo, before, after))  # fmt: skip
        t.append(time.perf_counter())
        solve(p, args.backend)
        t.append(time.perf_counter())
        torch.cuda.synchronize()
        t.append(time.perf_counter())
        rows.append({s: round((t[i + 1] - t[i]) * 1e3, 3) for i, s in enumerate(steps)})
        print(json.dumps(rows[-1]), flush=True)
    # the pinned staging buffer alone
    n = plan.num_pools + 64
    t0 = time.perf_counter()
    for _ in range(20):
        torch.empty(n, dtype=torch.int64, pin_memory=True)
    print(json.dumps({"pinned_empty_ms": round((time.perf_counter() - t0) / 20 * 1e3, 4), "elements": n}))


if __name__ == "__main__":
    main()
