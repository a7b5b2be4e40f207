"""Host time of one indexer call while the device is busy (does the call ever wait for it?).

    python -m sp_kpool.bench host [--backend deepgemm --precision fp8 --heads 32] [--out DIR]

A model's forward pass queues layer after layer ahead of the device; a call that makes the
host wait for the device (a copy from pageable memory, a ``.item()``) leaves the device idle
while the host queues the rest. This script queues a ~20 ms device sleep, then times on the
host the steps of the pipeline (the plan: host arithmetic and one copy; the backend's
``prepare`` of the pools and the queries, one launch for deepgemm) and a whole call
(stages 3-8, ``sp_kpool.pipeline.solve``) on the reference workload (rank 3 of 4 x 32768
tokens, D 128, topk 2048). A step that takes about as long as the sleep waited for the
device. The plan is timed building its tables (the sequence's table cache is cleared
first); the whole call that follows finds them cached, as every layer after the first does.
Prints one JSON line per round and the pinned staging buffer's cost; ``--out DIR`` also
writes ``host.json`` with the environment block.
"""

from __future__ import annotations

import time

import torch

from ..backends import BACKENDS
from ..backends.base import PoolInputs, QueryInputs
from ..pipeline import num_pools, solve
from ..plan import plan_chunks
from ..testing.problems import reference_slice_problem
from .record import command_line, environment, log, parse_call, parser, require_cuda, save


def main(argv=None) -> int:
    ap = parser("host", __doc__)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write host.json here")
    args = parse_call(ap, argv, "deepgemm", "fp8", 32)
    require_cuda("host")
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
        log(rows[-1])
    # the pinned staging buffer alone
    n = plan.num_pools + 64
    t0 = time.perf_counter()
    for _ in range(20):
        torch.empty(n, dtype=torch.int64, pin_memory=True)
    pinned = {"pinned_empty_ms": round((time.perf_counter() - t0) / 20 * 1e3, 4), "elements": n}
    log(pinned)
    if args.out:
        save({"environment": environment(command_line("host", argv)), "args": vars(args), "rounds": rows,
              "pinned": pinned}, args.out, "host.json")  # fmt: skip
    return 0
