"""Launched by torchrun: every rank's rows bitwise equal to world size 1.

    torchrun --standalone --nproc_per_node N tests/multigpu/sharded_check.py \
        [--arms bf16:torch,fp8:deepgemm,...] [--heads 64 --head-dim 128 --dtype bf16] [--scale]
        [--layout contiguous,zigzag,zigzag-per-document,positions]

NCCL with one GPU per rank when CUDA is available, gloo on CPU otherwise. Cases: odd global
lengths, pools straddling seams, shards starting mid-document, a shard holding only
padding (STANDARD_CASES), in each ``--layout`` (rows and ids compared after mapping stream
positions to real rows). Prints one PASS/FAIL line per rank, arm and layout; exit status 1
on any failure.

Runs with the package importable: installed (``pip install -e .``) or the repository root on
``PYTHONPATH`` (``test_launchers.py`` and ``scripts/gpu_evidence.sh`` set it).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from sp_kpool.testing.rank_checks import STANDARD_CASES, sharded_vs_world1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arms", default="bf16:torch", help="comma-separated precision:backend pairs to check")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--scale", action="store_true", help="also gather='pools' and balance='causal'")
    ap.add_argument("--layout", default="contiguous", help="comma-separated layouts (contiguous, zigzag, "
                    "zigzag-per-document, positions: a random permutation in uneven parts)")
    opts = ap.parse_args()
    layouts = opts.layout.split(",")
    known = ("contiguous", "zigzag", "zigzag-per-document", "positions")
    if any(lay not in known for lay in layouts):
        ap.error(f"--layout: expected a comma-separated list of {list(known)}, got {opts.layout!r}")
    dtype = getattr(torch, opts.dtype)
    variants = [{}]
    if opts.scale:
        variants += [{"gather": "pools"}, {"balance": "causal"}, {"gather": "pools", "balance": "causal"}]
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    rank, ws = dist.get_rank(), dist.get_world_size()
    failures = 0
    try:
        for arm in opts.arms.split(","):
            precision, name = arm.split(":")
            for layout in layouts:
                bad, n = [], 0
                for lengths, kpool, topk in STANDARD_CASES:
                    for tail, order in (("fixed", "ascending"), ("compact", "score")):
                        for extra in variants:
                            n += 1
                            rep = sharded_vs_world1(
                                rank, ws, lengths, kpool, topk, heads=opts.heads, head_dim=opts.head_dim,
                                seed=len(lengths), device=device, backend=name, precision=precision, dtype=dtype,
                                tail=tail, order=order, layout=layout, **extra,
                            )  # fmt: skip
                            if not rep.equal:
                                bad.append((lengths, kpool, topk, tail, order, extra))
                failures += len(bad)
                verdict = "PASS" if not bad else f"FAIL {bad}"
                print(f"torchrun rank {rank}/{ws} {backend} {device} arm={arm} layout={layout}: {n - len(bad)}/{n} "
                      f"cases equal: {verdict}", flush=True)  # fmt: skip
        flag = torch.tensor([failures], device=device if backend == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    finally:
        dist.destroy_process_group()
    return 0 if int(flag) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
