"""Cost of replaying a rollout selection (sp_kpool.replay.shard) against the baselines of issue #43.

Per capture kind, one document of ``--tokens`` tokens (default 65536), topk 2048, K 4: a valid
random capture (every row its ``min(512, visible)`` pools, in a random order, no row for the
last token) as pool ids (int16, 512 per row) and as token positions (int32, 2048 per row).
Measured in the same run, in alternation (``--repeat`` rounds, each figure its least time):
``torch.sort(capture, dim=1)`` of that very tensor (the baseline), ``shard`` at world size 1
and ``shard_local`` for rank 3 of a 4-rank zigzag split. Targets:
``shard`` at most 2x the sort (pools), 1.5x (tokens).

``--docs 16 --doc-tokens 2048`` (default; ``--docs 0`` skips it): the cost of the rows a
capture does not cover. A ``kpool_topk`` call (torch backend, FP32, ``--heads``,
``--head-dim``) gives the capture of every row; ``shard(missing="compute")`` of it, and of
it without each document's last row (the SGLang shape: 16 rows computed with
``kpool_topk(rows=)``). Target: the second costs at most the first plus 1/4 of the call.

``--subset-tokens 32768 --every 16`` (default; ``--subset-tokens 0`` skips it): one document,
``kpool_topk(rows=)`` on every 16th row against the full call (target: at most 1/8 of it),
and a sampled verification step of 1/16 of the rows (shard, ``rows=``, compare).

Prints one JSON line per measurement; ``--out FILE`` also writes them with the environment
block (:mod:`sp_kpool.bench.record`) as one JSON document ``{"environment", "records"}``.

Run: ``python -m sp_kpool.bench replay [--tokens 65536] [--device cpu|cuda] [--out bench_replay.json]``.
"""

from __future__ import annotations

import json
import os

import torch

from .. import KPoolConfig, ShardedSequence, kpool_topk, replay
from .record import command_line, environment, parser, save
from .timing import best_seconds


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


def alternating(fns: dict, repeat: int, dev) -> dict:
    """The least seconds of each of ``fns`` over ``repeat`` rounds, one call of each per round
    (a measurement and its baseline see the same load of a shared machine)."""
    best = {name: float("inf") for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            best[name] = min(best[name], best_seconds(fn, 1, dev))
    return best


def shard_cases(args, dev, emit) -> None:
    n, T, K = args.tokens, args.topk, args.kpool
    config = KPoolConfig(topk=T, kpool=K)
    pools = random_capture(n, T, K)
    caps = {
        "pools": [pools.to(torch.int16 if n // K <= 2**15 else torch.int32).to(dev)],
        "tokens": [torch.where(pools[:, :, None] >= 0, pools[:, :, None] * K + torch.arange(K), -1)
                   .reshape(n - 1, T).to(torch.int32).to(dev)],
    }  # fmt: skip
    del pools
    seq1 = ShardedSequence.split([0, n], 1, 0)
    seq4 = ShardedSequence.split([0, n], 4, 3, layout="zigzag")
    target = {"pools": 2.0, "tokens": 1.5}
    for kind, cap in caps.items():
        base = dict(tokens=n, topk=T, kpool=K, device=str(dev), capture_dtype=str(cap[0].dtype).replace("torch.", ""),
                    capture_shape=list(cap[0].shape), capture_bytes=cap[0].numel() * cap[0].element_size())  # fmt: skip
        t = alternating({
            "sort": lambda: torch.sort(cap[0], dim=1),
            "world size 1": lambda: replay.shard(cap, seq1, config, ids=kind, missing="empty", device=dev),
            "rank 3 of 4 (zigzag)": lambda: replay.shard_local(cap, seq4, config, ids=kind, device=dev),
        }, args.repeat, dev)  # fmt: skip
        emit({"what": f"torch.sort of the {kind} capture", **base, "seconds": round(t["sort"], 4)})
        for name, rows in (("world size 1", n), ("rank 3 of 4 (zigzag)", seq4.shard_size)):
            rec = {"what": f"replay.shard {kind}", "split": name, "rows": rows, **base, "seconds": round(t[name], 4)}
            if name == "world size 1":
                rec.update(vs_sort=round(t[name] / t["sort"], 2), target_vs_sort=target[kind])
            emit(rec)


def missing_rows_case(args, dev, emit) -> None:
    D, L, T, K = args.docs, args.doc_tokens, args.topk, args.kpool
    cu = [i * L for i in range(D + 1)]
    config = KPoolConfig(topk=T, kpool=K)
    S, H, Dh = cu[-1], args.heads, args.head_dim
    inputs = _inputs(S, H, Dh, K, dev)
    seq = ShardedSequence.split(cu, 1, 0)
    ids = None

    def call():
        nonlocal ids
        ids = kpool_topk(**inputs, seq=seq, config=config)

    call()
    full = replay.documents(ids, seq)
    last_missing = [c[:-1] for c in full]  # no row for each document's last token
    out = None

    def partial():
        nonlocal out
        out = replay.shard(last_missing, seq, config, missing="compute", inputs=inputs)

    t = alternating({
        "call": call,
        "covered": lambda: replay.shard(full, seq, config, missing="compute", inputs=inputs),
        "partial": partial,
    }, args.repeat, dev)  # fmt: skip
    call_s, full_s, part_s = t["call"], t["covered"], t["partial"]
    assert torch.equal(out, ids), "replay with computed rows differs from kpool_topk"
    base = dict(docs=D, doc_tokens=L, tokens=S, topk=T, kpool=K, heads=H, head_dim=Dh, dtype="float32",
                device=str(dev), backend="torch")  # fmt: skip
    emit({"what": "kpool_topk (full call)", **base, "seconds": round(call_s, 3)})
    emit({"what": "replay.shard tokens, every row covered", **base, "seconds": round(full_s, 4)})
    emit({"what": "replay.shard tokens, last row of each document computed", **base, "rows_computed": D,
          "seconds": round(part_s, 4), "extra_vs_full_call": round((part_s - full_s) / call_s, 4),
          "target_extra_vs_full_call": 0.25, "bitwise_equal_to_kpool_topk": True})  # fmt: skip


def _inputs(S: int, H: int, Dh: int, K: int, dev) -> dict:
    g = torch.Generator().manual_seed(0)
    inputs = {"q": torch.randn(S, H, Dh, generator=g), "k": torch.randn(S, Dh, generator=g),
              "gates": torch.randn(S, Dh, generator=g), "head_weights": torch.randn(S, H, generator=g),
              "ape": torch.randn(K, Dh, generator=g)}  # fmt: skip
    return {k: v.to(dev) for k, v in inputs.items()}


def row_subset_case(args, dev, emit) -> None:
    """``kpool_topk(rows=)`` on every ``--every``-th row of one ``--subset-tokens`` document
    against the full call, and a sampled verification step (``replay.shard`` of a covered
    capture, the sample computed with ``rows=``, ``replay.compare`` on it: what
    ``KPoolIndexer(mode="verify", verify_rows=1/every)`` runs besides the projections)."""
    S, T, K, H, Dh, every = args.subset_tokens, args.topk, args.kpool, args.heads, args.head_dim, args.every
    config = KPoolConfig(topk=T, kpool=K)
    inputs = _inputs(S, H, Dh, K, dev)
    seq = ShardedSequence.split([0, S], 1, 0)
    rows = torch.arange(every - 1, S, every)
    got = {}

    def full():
        got["full"] = kpool_topk(**inputs, seq=seq, config=config)

    def subset():
        got["rows"] = kpool_topk(**inputs, seq=seq, config=config, rows=rows.to(dev))

    full()
    capture = replay.documents(got["full"], seq)
    sample = replay.sample_rows(seq, 1.0 / every, seed=1)

    def verify():
        ids = replay.shard(capture, seq, config, inputs=inputs)
        computed = kpool_topk(**inputs, seq=seq, config=config, rows=sample.to(dev))
        got["report"] = replay.compare(ids, computed, seq, rows=sample)

    t = alternating({"full": full, "rows": subset, "verify": verify}, args.subset_repeat, dev)
    assert torch.equal(got["rows"][rows], got["full"][rows]), "rows= differs from the full call"
    assert bool((got["rows"][torch.ones(S, dtype=torch.bool).index_fill_(0, rows, False)] == -1).all())
    assert got["report"]["rows"] == sample.numel() and got["report"]["rows_differing"] == 0, got["report"]
    base = dict(docs=1, tokens=S, topk=T, kpool=K, heads=H, head_dim=Dh, dtype="float32", device=str(dev),
                backend="torch")  # fmt: skip
    emit({"what": "kpool_topk (full call)", **base, "seconds": round(t["full"], 3)})
    emit({"what": f"kpool_topk(rows=) on every {every}th row", **base, "rows_computed": rows.numel(),
          "seconds": round(t["rows"], 4), "vs_full_call": round(t["rows"] / t["full"], 4),
          "target_vs_full_call": 0.125, "bitwise_equal_to_kpool_topk": True})  # fmt: skip
    emit({"what": f"verify step: replay.shard + rows= on a 1/{every} sample + compare", **base,
          "rows_compared": sample.numel(), "seconds": round(t["verify"], 4),
          "vs_full_call": round(t["verify"] / t["full"], 4)})  # fmt: skip


def main(argv=None) -> int:
    ap = parser("replay", __doc__)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--kpool", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=5, help="rounds; each figure is its least time")
    ap.add_argument("--docs", type=int, default=16, help="documents of the missing-rows case (0: skip it)")
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--subset-tokens", type=int, default=32768,
                    help="one document of this many tokens for the rows= case (0: skip it)")
    ap.add_argument("--every", type=int, default=16, help="rows= asks for every N-th row (and verifies 1/N)")
    ap.add_argument("--subset-repeat", type=int, default=2, help="rounds of the rows= case")
    ap.add_argument("--skip-shard", action="store_true", help="skip the shard-vs-sort cases")
    ap.add_argument("--out", default=None, help="also write the records and the environment to this JSON file")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    records = []

    def emit(rec):
        records.append(rec)
        print(json.dumps(rec), flush=True)

    if not args.skip_shard:
        shard_cases(args, dev, emit)
    if args.docs:
        missing_rows_case(args, dev, emit)
    if args.subset_tokens:
        row_subset_case(args, dev, emit)
    if args.out:
        env = environment(command_line("replay", argv), dev)
        save({"environment": env, "records": records}, os.path.dirname(os.path.abspath(args.out)),
             os.path.basename(args.out))
    return 0
