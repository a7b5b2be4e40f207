"""Cost of replaying a rollout selection (sp_kpool.replay.shard): sharding + validating one layer.

A 131072-token document (default), topk 2048, K 4: a valid random capture (every row its
``min(512, visible)`` pools, in a random order) as token positions (int32, 2048 per row) and
as pool ids (int16, 512 per row); ``shard`` at world size 1 and ``shard_local`` for one rank
of a 4-rank zigzag split. Optionally one ``kpool_topk`` torch-backend call at smaller sizes
(``--compute-tokens``) to compare with. Prints one JSON line per measurement.

Run: ``python scripts/bench_replay.py [--tokens 131072] [--device cpu|cuda] [--compute-tokens 4096 8192]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from sp_kpool import KPoolConfig, ShardedSequence, kpool_topk, replay


def random_capture(n: int, topk: int, kpool: int, seed: int = 0) -> torch.Tensor:
    """``[n - 1, topk // kpool]`` int64 valid pool ids of one document (no row for the last token)."""
    g = torch.Generator().manual_seed(seed)
    k = topk // kpool
    j = torch.arange(n - 1)
    n_vis = (j + 1) // kpool
    out = torch.empty((n - 1, k), dtype=torch.int64)
    step = 8192
    for a in range(0, n - 1, step):
        b = min(n - 1, a + step)
        order = torch.argsort(torch.rand(b - a, k, generator=g), dim=1)
        pools = n_vis[a:b, None] - 1 - order  # the last k visible pools, shuffled
        out[a:b] = torch.where(pools >= 0, pools, -1)
    return out


def timed(fn, repeat: int, device) -> float:
    best = float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--kpool", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--compute-tokens", type=int, nargs="*", default=[])
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    n, T, K = args.tokens, args.topk, args.kpool
    config = KPoolConfig(topk=T, kpool=K)
    pools = random_capture(n, T, K)
    caps = {
        "pools": [pools.to(torch.int16 if n // K <= 2**15 else torch.int32).to(dev)],
        "tokens": [torch.where(pools[:, :, None] >= 0, pools[:, :, None] * K + torch.arange(K), -1)
                   .reshape(n - 1, T).to(torch.int32).to(dev)],
    }  # fmt: skip
    seq1 = ShardedSequence.split([0, n], 1, 0)
    seq4 = ShardedSequence.split([0, n], 4, 3, layout="zigzag")
    for kind, cap in caps.items():
        for name, fn in (
            ("world size 1", lambda: replay.shard(cap, seq1, config, ids=kind, missing="empty", device=dev)),
            ("rank 3 of 4 (zigzag)", lambda: replay.shard_local(cap, seq4, config, ids=kind, device=dev)),
        ):
            s = timed(fn, args.repeat, dev)
            print(json.dumps({"what": f"replay.shard {kind}", "rows": n if "1" in name[-1] else seq4.shard_size,
                              "split": name, "tokens": n, "topk": T, "kpool": K, "device": str(dev),
                              "seconds": round(s, 4), "capture_bytes": cap[0].numel() * cap[0].element_size()}))
    for m in args.compute_tokens:
        g = torch.Generator().manual_seed(0)
        H, D = 32, 128
        q, k = torch.randn(m, H, D, generator=g).bfloat16(), torch.randn(m, D, generator=g).bfloat16()
        gates, w = torch.randn(m, D, generator=g).bfloat16(), torch.randn(m, H, generator=g).bfloat16()
        ape = torch.randn(K, D, generator=g).bfloat16()
        s1 = ShardedSequence.split([0, m], 1, 0)
        s = timed(lambda: kpool_topk(q.to(dev), k.to(dev), gates.to(dev), w.to(dev), ape.to(dev), s1, config), 1, dev)
        print(json.dumps({"what": "kpool_topk torch", "tokens": m, "topk": T, "kpool": K, "heads": H, "head_dim": D,
                          "device": str(dev), "seconds": round(s, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
