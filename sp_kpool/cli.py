"""``python -m sp_kpool``: ``info`` (backends and why), ``demo`` (a checked sharded run)."""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["main"]


def _cmd_info(args) -> int:
    import platform

    import torch

    from . import __version__
    from .backends import BACKENDS
    from .backends.base import Problem
    from .sharding import ShardedSequence

    print(f"sp_kpool {__version__}, torch {torch.__version__}, python {platform.python_version()}")
    cuda = torch.cuda.is_available()
    print(f"cuda: {torch.cuda.get_device_name(0) if cuda else 'not available'}")
    dev = torch.device("cuda" if cuda else "cpu")
    H, D, K = args.heads, args.head_dim, 4
    seq = ShardedSequence.split([0, 8], world_size=1, rank=0)
    z = torch.zeros
    print(f"backends for H={H}, D={D}, bf16 inputs on {dev}:")
    for b in sorted(BACKENDS.values(), key=lambda b: -b.priority):
        for precision in b.precisions:
            p = Problem(
                q=z(8, H, D, dtype=torch.bfloat16, device=dev), head_weights=z(8, H, device=dev),
                k=z(8, D, dtype=torch.bfloat16, device=dev), gates=z(8, D, device=dev), ape=z(K, D, device=dev),
                seq=seq, topk=8, kpool=K, tail="fixed", order="ascending", alignment=1,
                max_logits_bytes=1 << 20, precision=precision,
            )  # fmt: skip
            why = b.not_supported_reasons(p)
            state = "available" if not why else "unavailable: " + "; ".join(why)
            print(f"  {b.name:<10} precision={precision:<13} priority={b.priority:<3} {state}")
    return 0


def _cmd_demo(args) -> int:
    from .testing.dist import run_ranks
    from .testing.problems import random_doc_lengths

    lengths = random_doc_lengths(args.tokens, args.docs, seed=args.seed)
    print(
        f"sp_kpool demo: {args.world_size} gloo ranks, {args.tokens} tokens in {args.docs} documents "
        f"{lengths}, H={args.heads} D={args.head_dim} kpool={args.kpool} topk={args.topk}",
        flush=True,
    )
    t0 = time.perf_counter()
    reports = run_ranks(_demo_rank, args.world_size, (lengths, args), timeout=args.timeout)
    dt = time.perf_counter() - t0
    print(f"{'rank':>4}  {'shard':>15}  {'real rows':>9}  {'selected ids':>12}  equal to world size 1")
    for rep in reports:
        shard = f"[{rep.shard[0]}, {rep.shard[1]})"
        print(f"{rep.rank:>4}  {shard:>15}  {rep.real_rows:>9}  {rep.selected:>12}  {'yes' if rep.equal else 'NO'}")
    ok = all(r.equal for r in reports)
    print(f"{'PASS' if ok else 'FAIL'}: {sum(r.equal for r in reports)}/{len(reports)} ranks bitwise equal ({dt:.1f} s)")
    return 0 if ok else 1


def _demo_rank(rank, world_size, lengths, args):
    from .testing.rank_checks import sharded_vs_world1

    return sharded_vs_world1(
        rank, world_size, lengths, args.kpool, args.topk, heads=args.heads, head_dim=args.head_dim, seed=args.seed
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sp_kpool", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    info = sub.add_parser("info", help="print every backend, available or not, and why")
    info.add_argument("--heads", type=int, default=64)
    info.add_argument("--head-dim", type=int, default=128)
    demo = sub.add_parser("demo", help="a sharded CPU run (gloo) checked against world size 1")
    demo.add_argument("--world-size", type=int, default=4)
    demo.add_argument("--tokens", type=int, default=4099, help="global length (odd by default)")
    demo.add_argument("--docs", type=int, default=5)
    demo.add_argument("--heads", type=int, default=16)
    demo.add_argument("--head-dim", type=int, default=64)
    demo.add_argument("--kpool", type=int, default=4)
    demo.add_argument("--topk", type=int, default=256)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    return {"info": _cmd_info, "demo": _cmd_demo}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
