"""End-to-end benchmark of ``kpool_topk``: every backend, precision, gather and balance option.

    # one process (world size 1), e.g. one GPU
    python -m sp_kpool.bench e2e --backends torch --seq-lens 4096,8192
    # several ranks spawned here (gloo on CPU; NCCL when there is a GPU per rank)
    python -m sp_kpool.bench e2e --world-size 4 --gathers keys,pools --balances none,causal
    # several GPUs under torchrun (NCCL, one GPU per rank, one host)
    torchrun --standalone --nproc_per_node 2 -m sp_kpool.bench e2e --backends tilelang,deepgemm ...

For each configuration (sequence length x layout x backend x precision x gather x balance)
every rank runs the real operator on its rows: warm-up calls, then ``--iters`` timed calls (barrier,
device synchronized; the step time is the slowest rank's), then one instrumented call
(``stats=``) that gives per-stage times (gather, seam, pool, balance exchange, score, select,
balance route, expand; device synchronized around each stage), the bytes every rank sent
and received (counted by the collectives), the rows it scored and their causal
query-pool pairs. Every output is compared bit for bit with the first option combination
of the same (length, backend, precision), normally ``gather=keys, balance=none``.

Measured in the same run, per rank 0 (:func:`sp_kpool.bench.timing.ceilings`): the
matrix-product ceiling (FP32 and BF16, FP8 on CUDA), the device copy bandwidth, and the
all-gather bandwidth of the process group.
Reported against them: score TFLOP/s (``2 * H * D`` per causal pair), pool / select /
expand GB/s (model bytes, stated in the JSON), gather GB/s (instrumented bytes).

Writes, under ``--out`` (default ``benchmarks/results``), ``bench_<tag>_<time>.json`` (after
every configuration, so a crash keeps what finished), ``.md`` (a table) and ``.png`` (time
per stage vs sequence length, one panel per backend/precision and option combination),
with the environment block of :mod:`sp_kpool.bench.record`. The reporting (summary per
configuration, table, plot, the fit of the balance work model) lives in
:mod:`sp_kpool.bench.report`; ``python -m sp_kpool.bench report`` re-draws or merges finished runs.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import resource
import statistics
import sys
import time

import torch

from .record import command_line, environment, parser
from .report import add_ratios, fit_row_cost, one_line, summarize, write_outputs
from .timing import ceilings as measure_ceilings

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def _csv(kind):
    def parse(text: str):
        return [kind(v) for v in text.split(",") if v.strip()]

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    from sp_kpool.config import BALANCES, GATHERS
    from sp_kpool.precision import PRECISIONS

    ap = parser("e2e", __doc__)
    ap.add_argument("--world-size", type=int, default=1, help="ranks to spawn here (ignored under torchrun)")
    ap.add_argument("--backends", type=_csv(str), default=["torch"], help="comma list of names in BACKENDS, or auto")
    ap.add_argument("--precisions", type=_csv(str), default=["bf16"], help=f"comma list of {list(PRECISIONS)}")
    ap.add_argument("--gathers", type=_csv(str), default=["keys", "pools"], help=f"comma list of {list(GATHERS)}")
    ap.add_argument("--balances", type=_csv(str), default=["none", "causal"], help=f"comma list of {list(BALANCES)}")
    ap.add_argument("--seq-lens", type=_csv(int), default=[4096, 8192], help="global packed lengths S")
    ap.add_argument("--docs", type=int, default=1, help="documents per sequence (1: one long document)")
    ap.add_argument("--layouts", type=_csv(str), default=["contiguous"],
                    help="comma list of contiguous, zigzag, zigzag-per-document, positions (a random permutation)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--kpool", type=int, default=4)
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="dtype of q, k, gates, head weights")
    ap.add_argument("--max-logits-bytes", type=int, default=None, help="scoring budget (default: the library's)")
    ap.add_argument("--balance-block", type=int, default=None, help="balance boundary multiple (default: chunk)")
    ap.add_argument("--balance-row-cost", type=int, default=None,
                    help="per-row constant of the balance work model (default: the backend's)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--tag", default=None, help="file name tag (default: device, backend and world size)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="process-group timeout, seconds")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    from sp_kpool.backends import backend_names

    for name, values, allowed in (
        ("--backends", args.backends, backend_names()),
        ("--precisions", args.precisions, PRECISIONS),
        ("--gathers", args.gathers, GATHERS),
        ("--balances", args.balances, BALANCES),
    ):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            ap.error(f"{name}: expected a comma list of {list(allowed)}, got {values}")
    if any(s < 1 for s in args.seq_lens) or args.docs < 1 or args.iters < 1 or args.warmup < 0:
        ap.error("--seq-lens, --docs and --iters must be positive, --warmup >= 0")
    args.command = command_line("e2e", argv)
    if _torchrun():
        args.command = "torchrun " + args.command.removeprefix("python ")
    return args


def _torchrun() -> bool:
    """Whether this process is one rank of a ``torchrun`` launch."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_torchelastic_launched()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------- inputs


def doc_lengths(total: int, docs: int, seed: int) -> list[int]:
    from sp_kpool.testing.problems import random_doc_lengths

    return [total] if docs == 1 else random_doc_lengths(total, min(docs, total), seed)


def local_inputs(seq, args, device: torch.device, rank: int) -> dict:
    """This rank's rows, generated on the device from ``(seed, rank)``: ``q [S_local, H, D]``,
    ``k``/``gates [S_local, D]``, ``head_weights [S_local, H]``, ``ape [K, D]`` (same on all
    ranks). Different ranks hold different rows, as in a real sharded step."""
    dt = _DTYPES[args.dtype]
    n, H, D, K = seq.shard_size, args.heads, args.head_dim, args.kpool
    g = torch.Generator(device=device).manual_seed(args.seed * 7919 + rank)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dt)

    inputs = {"q": rnd(n, H, D), "k": rnd(n, D), "gates": rnd(n, D), "head_weights": rnd(n, H)}
    ga = torch.Generator(device=device).manual_seed(args.seed * 7919 - 1)
    inputs["ape"] = (torch.randn(K, D, generator=ga, device=device) * 0.5).to(dt)
    return inputs


# ------------------------------------------------------------------------------- runs


def _peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "torch.cuda.max_memory_allocated (this config)"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "ru_maxrss (process peak so far)"


def run_config(args, seq, inputs, device, cfg: dict, baseline) -> tuple[dict, torch.Tensor | None]:
    """One configuration on this rank. Returns (this rank's record, output)."""
    from sp_kpool import kpool_topk

    dist_on = seq.world_size > 1
    if dist_on:
        import torch.distributed as dist
    kw = dict(
        topk=args.topk, kpool=args.kpool, backend=cfg["backend"], precision=cfg["precision"], gather=cfg["gather"],
        balance=cfg["balance"], balance_block=args.balance_block, balance_row_cost=args.balance_row_cost,
        max_logits_bytes=args.max_logits_bytes,
    )  # fmt: skip
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rec: dict = {"rank": seq.rank}
    try:
        out = None
        for _ in range(args.warmup):
            out = kpool_topk(**inputs, seq=seq, **kw)
        times = []
        for _ in range(args.iters):
            if dist_on:
                dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            out = kpool_topk(**inputs, seq=seq, **kw)
            _sync(device)
            times.append(time.perf_counter() - t0)
        stats: dict = {}
        if dist_on:
            dist.barrier()
        out_stats = kpool_topk(**inputs, seq=seq, stats=stats, **kw)
    except ValueError as exc:  # bad configuration: raised on every rank alike
        return {"rank": seq.rank, "skipped": str(exc).splitlines()[-1][:500]}, None
    rec["time_s"] = statistics.median(times)
    rec["times_s"] = times
    rec["stage_s"] = stats["time_s"]
    rec["instrumented_total_s"] = sum(stats["time_s"].values())
    rec["bytes"] = stats["bytes"]
    rec["rows_scored"] = list(stats["rows_scored"])
    rec["causal_pairs"] = stats["causal_pairs"]
    rec["scored_cells"] = stats["scored_cells"]
    rec["pools"] = stats["pools"]
    rec["pools_built"] = stats["pools_built"]
    rec["partition"] = stats["partition"]
    rec["balance_applied"] = stats["balance_applied"]
    rec["peak_memory_bytes"], rec["peak_memory_kind"] = _peak_memory_bytes(device)
    rec["deterministic"] = bool(torch.equal(out, out_stats))
    rec["equal_to_baseline"] = None if baseline is None else bool(torch.equal(out, baseline))
    return rec, out


# ------------------------------------------------------------------------------ ranks


def main_rank(args, rank: int, world_size: int, device: torch.device, dist_backend: str | None) -> None:
    from sp_kpool.testing.rank_checks import layout_seq

    dist_on = world_size > 1
    if dist_on:
        import torch.distributed as dist
    if device.type == "cuda":  # make the optional GPU packages visible in the environment record
        for mod in ("triton", "tilelang", "deep_gemm"):
            try:
                __import__(mod)
            except Exception:  # noqa: BLE001
                pass
    env = environment(args.command, device, world_size=world_size, dist_backend=dist_backend, device=str(device))
    for mod in ("triton", "tilelang", "deep_gemm"):
        if mod in sys.modules:
            env[mod] = getattr(sys.modules[mod], "__version__", "?")
    tag = args.tag or "{}-{}-w{}".format(
        "gpu" if device.type == "cuda" else "cpu", dist_backend or "single", world_size
    )
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    base = os.path.join(args.out, f"bench_{tag}_{stamp}")
    _log(rank, f"bench: {world_size} rank(s), {dist_backend or 'single process'}, {device}; "
               f"measuring ceilings ...")  # fmt: skip
    ceilings = measure_ceilings(device, world_size)
    _log(rank, "ceilings: " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in ceilings.items()}))
    doc = {"environment": env, "ceilings": ceilings, "args": {k: v for k, v in vars(args).items()}, "results": []}
    combos = [(g, b) for g in args.gathers for b in args.balances]
    total = len(args.seq_lens) * len(args.layouts) * len(args.backends) * len(args.precisions) * len(combos)
    i = 0
    for S, layout in ((S, layout) for S in args.seq_lens for layout in args.layouts):
        lengths = doc_lengths(S, args.docs, args.seed)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        seq = layout_seq(cu, rank, world_size, layout, seed=args.seed)
        inputs = local_inputs(seq, args, device, rank)
        owned = seq.real_rows().numel()
        for backend in args.backends:
            for precision in args.precisions:
                baseline = None
                for gather, balance in combos:
                    i += 1
                    cfg = dict(seq_len=S, docs=len(lengths), layout=layout, backend=backend, precision=precision,
                               gather=gather,
                               balance=balance, heads=args.heads, head_dim=args.head_dim, topk=args.topk,
                               kpool=args.kpool, dtype=args.dtype)  # fmt: skip
                    label = f"[{i}/{total}] S={S} {layout} {backend} {precision} gather={gather} balance={balance}"
                    _log(rank, label + " ...")
                    t0 = time.perf_counter()
                    rec, out = run_config(args, seq, inputs, device, cfg, baseline)
                    rec["owned_rows"] = owned
                    if baseline is None and out is not None:
                        baseline = out
                    if dist_on:
                        per_rank: list = [None] * world_size
                        dist.all_gather_object(per_rank, rec)
                    else:
                        per_rank = [rec]
                    summary = summarize(args, cfg, per_rank, ceilings, device)
                    doc["results"].append({"config": cfg, "summary": summary, "per_rank": per_rank})
                    add_ratios(doc["results"])
                    if rank == 0:
                        write_outputs(base, doc, plot=False)
                    _log(rank, label + " " + one_line(summary, time.perf_counter() - t0))
                    del out
                del baseline
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if rank == 0:
        doc["balance_fit"] = fit_row_cost(doc["results"])
        print("balance work model fit (score + select = a * pairs + b * rows): "
              + json.dumps(doc["balance_fit"]), flush=True)  # fmt: skip
        write_outputs(base, doc, plot=not args.no_plot)
        print(f"wrote {base}.json, .md" + ("" if args.no_plot else ", .png"), flush=True)


def _spawned(rank: int, ws: int, args, dist_backend: str) -> None:
    """One rank spawned by ``run_ranks`` (process group already initialized)."""
    if dist_backend == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ws))
    main_rank(args, rank, ws, device, dist_backend)


def main(argv=None) -> int:
    args = parse_args(argv)
    if _torchrun():  # one host (--standalone): rank r on GPU r modulo the GPUs
        from datetime import timedelta

        import torch.distributed as dist

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
        ws, rank = dist.get_world_size(), dist.get_rank()
        args.command = args.command.replace("torchrun ", f"torchrun --nproc_per_node {ws} ", 1)  # one host
        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        try:
            main_rank(args, rank, ws, device, backend if ws > 1 else None)
        finally:
            dist.destroy_process_group()
        return 0
    if args.world_size == 1:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        main_rank(args, 0, 1, device, None)
        return 0
    from sp_kpool.testing.dist import run_ranks

    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= args.world_size else "gloo"
    run_ranks(_spawned, args.world_size, (args, backend), backend=backend, timeout=float("inf"), pg_timeout=args.timeout)
    return 0

