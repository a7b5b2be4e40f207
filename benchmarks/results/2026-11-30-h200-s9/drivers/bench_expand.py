"""Single-GPU benchmark of the expansion kernel (``triton_select.expand_pools``): pools to
token ids, tail and layout, on the shape of the reference workload's rank-3 slice.

    python scripts/bench_expand.py [--rows 32768] [--k 512] [--kpool 4] [--launch 2:4,4:4,...] [--out DIR]

Inputs: ``--rows`` rows of ``--k`` ascending pool ids out of ``4 * rows`` pools (a few rows
with fewer or no valid pools), token budget ``k * kpool``, widths ``k * kpool + kpool - 1``
(alignment 1, unaligned rows) and that rounded up to 16 columns. Times each launch
``rows_per_program:num_warps`` (the library default first) and checks that it writes the
same output as the default. Writes ``bench_expand.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from sp_kpool.kernels.triton_select import expand_pools  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import bench, log, save  # noqa: E402


def inputs(rows: int, k: int, kpool: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    P = 4 * rows
    keys = torch.rand((rows, P // 8), generator=g, device="cuda")
    pools = torch.topk(keys, k, dim=1).indices.sort(dim=1).values * 8  # distinct, ascending
    nvalid = torch.full((rows,), k, device="cuda")
    nvalid[::97] = torch.randint(0, k, (nvalid[::97].numel(),), generator=g, device="cuda")
    pools = torch.where(torch.arange(k, device="cuda")[None] < nvalid[:, None], pools, -1).int()
    pts = torch.arange(P, dtype=torch.int64, device="cuda") * kpool
    row_ids = torch.arange(rows, dtype=torch.int64, device="cuda") + 3 * rows
    tail_len = row_ids % kpool
    return pools, pts, row_ids, tail_len


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--kpool", type=int, default=4)
    ap.add_argument("--launch", default="1:4,2:4,4:4,1:8,2:8,4:8,1:2,8:4", help="rows_per_program:num_warps,...")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "args": vars(args), "runs": []}  # fmt: skip
    pools, pts, rows, tail_len = inputs(args.rows, args.k, args.kpool)
    topk = args.k * args.kpool
    for width in (topk + args.kpool - 1, -(-(topk + args.kpool - 1) // 16) * 16):
        for tail in ("fixed", "compact"):
            out = torch.empty((args.rows, width), dtype=torch.int32, device="cuda")
            ref = expand_pools(pools, pts, rows, tail_len, out.clone(), topk=topk, kpool=args.kpool, tail=tail)
            for launch in ["default", *args.launch.split(",")]:
                kw = {} if launch == "default" else dict(zip(("rows_per_program", "num_warps"), map(int, launch.split(":"))))
                got = expand_pools(pools, pts, rows, tail_len, out.fill_(7), topk=topk, kpool=args.kpool, tail=tail, **kw)
                same = torch.equal(got, ref)
                ms = bench(lambda: expand_pools(pools, pts, rows, tail_len, out, topk=topk, kpool=args.kpool, tail=tail, **kw),  # noqa: B023
                           reps=20)  # fmt: skip
                row = {"width": width, "tail": tail, "launch": launch, "ms": ms, "equal_default": same,
                       "write_gbps": out.numel() * 4 / ms / 1e6}  # fmt: skip
                res["runs"].append(row)
                log(json.dumps(row))
    save(res, args.out, "bench_expand.json")


if __name__ == "__main__":
    main()
