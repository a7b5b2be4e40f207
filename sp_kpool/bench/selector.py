"""Single-GPU benchmark and check of the Triton Top-K selector (``topk_ascending``).

    python -m sp_kpool.bench select [--rows 16384] [--pools 32768] [--k 512] [--out DIR]

Logits like one scoring chunk of the reference workload (SPEC 9): ``--rows`` query rows of
the rank-3 slice of a 4-rank split, row ``r`` visible on ``[0, end_r)`` with ``end_r`` from
``3/4 * pools`` to ``pools`` (``-inf`` elsewhere), FP32 scores from a ReLU-weighted random
model. Times, on the same logits: ``topk_ascending`` for several launch configurations,
LMDeploy's ``sparse_index_topk`` and ``torch.topk`` (value only, no exact ties rule), and
with ``--selectors`` the registered selectors as the pipeline calls them (time, peak memory); checks
every configuration against the exact int64-key Top-K (``selection.topk_pools``), also on
inputs with heavy exact ties. Writes ``bench_select.json``. The logits, the exact reference
and the timing come from :mod:`sp_kpool.bench.inputs` and :mod:`sp_kpool.bench.timing`.
"""

from __future__ import annotations

import json

import torch

from .inputs import exact_ascending, selector_logits
from .record import command_line, environment, launch_kwargs, log, parser, require_cuda, save
from .timing import median_ms


def bench(fn):
    """Median milliseconds of ``fn()`` over 10 runs after 2 warm-up runs (CUDA events)."""
    return median_ms(fn, reps=10, warmup=2)


def exact(s, ends, k, base):
    return exact_ascending(s, s > -float("inf"), k, base)


def launch(cfg, sms):
    """Keyword arguments of ``topk_ascending`` for ``'warps:ways:maxnreg[:tile[:per_sm]]'`` or
    ``'default'``, either followed by ``+name=value`` keyword arguments passed as they are
    (e.g. ``default+capg=1024``, ``default+vsteps=0+ways=2``)."""
    cfg, *opts = cfg.split("+")
    extra = launch_kwargs(opts)
    if cfg == "default":
        return extra
    vals = [int(x) for x in cfg.split(":")] + [0, 0]
    warps, ways, maxnreg, tile, per_sm = vals[:5]
    return {"num_warps": warps or None, "ways": ways or 2, "maxnreg": maxnreg or None, "tile": tile or None,
            "programs": per_sm * sms if per_sm else None, **extra}  # fmt: skip


def registered(s, starts, ends, k, base, ref, names) -> dict:
    """Each registered dense selector of ``names`` (:data:`sp_kpool.selectors.SELECTORS`) called
    as the pipeline calls it (ascending order, the rows' ranges) on the logits ``s``: median ms,
    peak extra device memory (MiB over the inputs) and whether its ids equal the exact ones."""
    from ..selectors import SELECTORS

    out = {}
    for name in names:
        sel = SELECTORS[name]
        f = lambda: sel.select(s, None, k, base, starts, ends, "ascending")  # noqa: E731
        try:
            got = f()
        except Exception as exc:  # noqa: BLE001  (a selector this host cannot run: say why)
            out[name] = f"unavailable: {type(exc).__name__}: {exc}"
            continue
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        f()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        out[name] = {"ms": bench(f), "peak_extra_mib": round(peak, 1), "equal_exact": bool(torch.equal(got, ref))}
        log(f"selector {name}: {out[name]}")
    return out


def main(argv=None) -> int:
    ap = parser("select", __doc__)
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--pools", type=int, default=32768)
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--configs", default="default,8:2:64,8:3:64,4:2:64,8:2:0",
                    help="comma-separated 'warps:ways:maxnreg[:tile[:per_sm]]' (0: the kernel's default) or 'default', "
                         "each optionally followed by '+name=value' keyword arguments of topk_ascending (e.g. capg)")
    ap.add_argument("--selectors", default="",
                    help="comma-separated registered selectors to time as the pipeline calls them (e.g. "
                         "int64-keys,fp32-candidates,radix,triton): median ms, peak extra memory, ids exact")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    require_cuda("select")
    from ..kernels import triton_topk
    from ..kernels.triton_topk import topk_ascending

    res = {"environment": environment(command_line("select", argv), packages=("triton", "lmdeploy")),
           "args": vars(args), "runs": []}  # fmt: skip
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    base = 1000
    for levels in (0, 7, 1000):
        s, ends = selector_logits(args.rows, args.pools, levels, seed=levels)
        starts = torch.zeros_like(ends)
        bvec = torch.full((args.rows,), base, dtype=torch.int64, device="cuda")
        ref = exact(s, ends, args.k, base)
        row = {"levels": levels, "gib": s.numel() * 4 / 2**30, "configs": {}}
        for cfg in args.configs.split(","):
            kw = launch(cfg, sms)
            f = lambda: topk_ascending(s, starts, ends, bvec, args.k, **kw)  # noqa: E731
            got = f()
            ok = torch.equal(got, ref)
            ms = bench(f)
            row["configs"][cfg] = {"ms": ms, "equal_exact": ok, "gb_per_s": s.numel() * 4 / ms / 1e6,
                                   "launch": dict(triton_topk.last_launch)}  # fmt: skip
            log(f"levels={levels} cfg={cfg} {ms:.3f} ms equal={ok} launch={triton_topk.last_launch}")
        if args.selectors:
            row["selectors"] = registered(s, starts, ends, args.k, base, ref, args.selectors.split(","))
        if levels == 0:
            row["torch_topk_ms"] = bench(lambda: torch.topk(s, args.k, dim=-1))
            try:
                from lmdeploy.pytorch.kernels.cuda.sparse_index_topk import sparse_index_topk

                ones = torch.ones(args.rows, dtype=torch.int32, device="cuda")
                row["lmdeploy_topk_ms"] = bench(lambda: sparse_index_topk(s, ones, ends, args.k))
            except Exception as exc:  # noqa: BLE001
                row["lmdeploy_topk"] = f"unavailable: {type(exc).__name__}: {exc}"
        res["runs"].append(row)
        log(json.dumps(row))
        del s, ref
        torch.cuda.empty_cache()
    save(res, args.out, "bench_select.json")
    return 0
