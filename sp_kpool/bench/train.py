"""CPU benchmark of the indexer's KL loss (``sp_kpool.indexer_kl_loss``) against one
``kpool_topk`` call of the torch backend, with the peak memory of each.

    python -m sp_kpool.bench train                     # the issue's case: 16384 tokens, FP32,
                                                       # H 32, D 128, topk 2048, Hq 16, Dqk 128
    python -m sp_kpool.bench train --tokens 4096 --docs 4 --out /tmp/x

Each measurement runs in a fresh process (spawned), so its peak resident memory
(``ru_maxrss``) is its own: the figure reported is that peak minus the resident memory after
the inputs were built. Arms, each on the same inputs (one seed): ``select`` (one
``kpool_topk`` call; it also writes the ids the sparse arm uses), ``sparse`` (the loss with a
``TokenMass`` teacher on those ids, forward and backward), ``dense`` (the warm-up: every
visible pool, an ``AttentionTeacher``, forward and backward). Reported: seconds (best of
``--reps``), the ratios sparse/select and dense/select, and MiB. Writes ``bench_train.json``
under ``--out``: ``{"environment", "args", "arms"}`` (the environment block of
:mod:`sp_kpool.bench.record`).
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import tempfile
import time

import torch

import sp_kpool

from .record import command_line, environment, log, parser, save


def _inputs(a):
    g = torch.Generator().manual_seed(a.seed)
    N = a.tokens
    per = N // a.docs
    lengths = [per] * (a.docs - 1) + [N - per * (a.docs - 1)]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    x = dict(q=rnd(N, a.heads, a.dim), k=rnd(N, a.dim), gates=rnd(N, a.dim), head_weights=rnd(N, a.heads),
             ape=rnd(a.kpool, a.dim, scale=0.5))  # fmt: skip
    seq = sp_kpool.ShardedSequence.split(cu, world_size=1, rank=0)
    teacher = (rnd(N, a.hq, a.dqk), rnd(N, a.dqk), rnd(N, a.hq) + 8.0)
    return x, seq, teacher


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _arm(name, a, ids_path, queue):
    torch.set_num_threads(a.threads)
    x, seq, (qt, kt, lse) = _inputs(a)
    K = a.kpool
    if name != "select":
        ids = torch.load(ids_path)
        g = torch.Generator().manual_seed(a.seed + 1)
        mass = torch.rand(ids.shape, generator=g) * (ids >= 0)
    base = _rss_mib()
    times = []
    for _ in range(a.reps):
        leaves = {n: t.clone().requires_grad_(name != "select") for n, t in x.items()}
        t0 = time.perf_counter()
        if name == "select":
            ids = sp_kpool.kpool_topk(**leaves, seq=seq, topk=a.topk, kpool=K, backend="torch")
        else:
            teacher = sp_kpool.TokenMass(mass) if name == "sparse" else sp_kpool.AttentionTeacher(qt, kt, lse, a.dqk**-0.5)
            loss = sp_kpool.indexer_kl_loss(**leaves, seq=seq, teacher=teacher, topk=a.topk, kpool=K,
                                            selection=ids if name == "sparse" else "dense")  # fmt: skip
            loss.backward()
        times.append(time.perf_counter() - t0)
    if name == "select":
        torch.save(ids, ids_path)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    queue.put({"arm": name, "seconds": min(times), "all_seconds": times, "peak_extra_mib": peak - base,
               "inputs_rss_mib": base})  # fmt: skip


def _run(name, a, ids_path):
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_arm, args=(name, a, ids_path, q))
    p.start()
    res = q.get()
    p.join()
    return res


def main(argv=None) -> int:
    ap = parser("train", __doc__)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--docs", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--kpool", type=int, default=4)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--hq", type=int, default=16)
    ap.add_argument("--dqk", type=int, default=128)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default="select,sparse,dense")
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args(argv)
    arms = a.arms.split(",")
    res = {"environment": environment(command_line("train", argv), "cpu", threads=a.threads), "args": vars(a),
           "arms": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="sp_kpool_bench_train_") as tmp:
        ids_path = os.path.join(tmp, "ids.pt")
        for name in ["select"] + [n for n in arms if n != "select"]:
            log(f"[train] {name} ...")
            r = _run(name, a, ids_path)
            res["arms"][name] = r
            log(f"[train] {name}: {r['seconds']:.2f} s, peak extra {r['peak_extra_mib']:.0f} MiB")
    sel = res["arms"]["select"]["seconds"]
    for name in ("sparse", "dense"):
        if name in res["arms"]:
            res["arms"][name]["ratio_to_select"] = res["arms"][name]["seconds"] / sel
            log(f"[train] {name} / select = {res['arms'][name]['ratio_to_select']:.2f}")
    save(res, a.out, "bench_train.json")
    return 0
