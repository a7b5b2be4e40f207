"""Benchmark of the fused FP8 path against the dense path and DeepGEMM alone, in one run.

    python -m sp_kpool.bench fused [--heads 32,64,128] [--topk 2048,8192] [--cases W,W262k,packed64] [--out DIR]
    python -m sp_kpool.bench fused --sweep [--heads 32,64] [--caps 0:8,0:4] [--out DIR]

Cases (rank 3 of a 4-rank split, D 128, kpool 4, each topk of ``--topk``, default 2048): ``W`` one
131072-token document (the reference slice), ``W262k`` one 262144-token document,
``packed64`` 64 documents of 2048 tokens. For each case and H, by ``triton.testing.do_bench``:
the whole call (``sp_kpool.pipeline.solve``, deepgemm backend) unfused and fused
(``Settings(fused=True)``), DeepGEMM ``fp8_mqa_logits`` alone on the same prepared inputs
(all rows in one call, ``clean_logits=False``), the Triton kernel alone in its dense mode and
fused (both ways of taking buffer slots), the dense mode without its stores (the scorer's own
cost; also with two q-blocks per program); the ratios to DeepGEMM alone; candidates per row
the gate let through (mean, max); peak extra device memory of one whole call each way; and
whether the fused ids equal the unfused ones. ``recency``: the kernel alone on W's inputs with
pool scales rising along the sequence (later pools score higher). At H 128 (DeepGEMM's SM90
API refuses it; the deepgemm backend scores with the Triton kernel's dense mode) there is no
DeepGEMM arm: ``whole_dense_over_scorer`` compares each whole call with the scorer it uses
(DeepGEMM at H 32 and 64, the Triton dense mode at H 128). Writes ``bench_fused.json``.
``--sweep``: the kernel's launch shapes (:data:`SWEEP`) on W instead, ``bench_fused_sweep.json``.
The slices and their prepared inputs: :mod:`sp_kpool.bench.inputs`.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ..backends import BACKENDS
from ..pipeline import RunRecord, solve
from ..settings import Settings
from ..testing.problems import rank_slice_problem
from .inputs import SLICES, prepared, slice_problem
from .record import command_line, environment, log, parser, require_cuda, save
from .timing import do_bench_ms, peak_mb


def one(case: str, H: int, topk: int, total: int | None = None, lengths: list[int] | None = None) -> dict:
    """The measurements of one case (``SLICES[case]``, or ``total`` tokens in documents of
    ``lengths``, one document if ``None``, under the name ``case``) at ``H`` heads."""
    import deep_gemm

    from ..kernels import triton_fp8_fused as ff

    total, lengths = SLICES[case] if total is None else (total, lengths)
    p = rank_slice_problem(total, 4, 3, heads=H, head_dim=128, topk=topk, precision="fp8", lengths=lengths,
                           max_logits_bytes=2 * 2**30, device="cuda")  # fmt: skip
    dense_p = dataclasses.replace(p, settings=Settings(fused=False))
    fused_p, record = dataclasses.replace(p, settings=Settings(fused=True)), RunRecord()
    res = {"case": case, "H": H, "topk": topk, "rows": p.seq.shard_size}
    t0 = time.perf_counter()
    want = solve(dense_p, "deepgemm").ids
    got = solve(fused_p, "deepgemm", record).ids
    res["fused_equals_dense"] = bool(torch.equal(got, want))
    res["fused_selector"] = record.counters.get("selector")
    ov = record.counters.get("overflow_rows")  # the selector's own count (its buffer cannot overflow)
    res["overflow_rows"] = None if ov is None else int(ov)
    res["whole_dense_ms"] = do_bench_ms(lambda: solve(dense_p, "deepgemm"))
    res["whole_fused_ms"] = do_bench_ms(lambda: solve(fused_p, "deepgemm"))
    res["peak_extra_mib_dense"] = peak_mb(lambda: solve(dense_p, "deepgemm"))
    res["peak_extra_mib_fused"] = peak_mb(lambda: solve(fused_p, "deepgemm"))
    # the same prepared inputs for the kernels alone: all this rank's rows in one call
    be = BACKENDS["deepgemm"]
    q8, wq, k8, ks, starts, ends, lo = prepared(p)
    k = topk // p.kpool
    dg = H in be.deepgemm_heads
    if dg:
        res["deepgemm_alone_ms"] = do_bench_ms(lambda: deep_gemm.fp8_mqa_logits(q8, (k8, ks), wq, starts, ends,
                                                                                  clean_logits=False))  # fmt: skip
    res["triton_dense_alone_ms"] = do_bench_ms(lambda: ff.score_select(q8, wq, k8, ks, starts, ends, k, dense=True))
    res["triton_fused_alone_ms"] = do_bench_ms(lambda: ff.score_select(q8, wq, k8, ks, starts, ends, k))
    other = "scan" if ff.SLOTS == "atomic" else "atomic"
    res[f"triton_fused_{other}_alone_ms"] = do_bench_ms(lambda: ff.score_select(q8, wq, k8, ks, starts, ends, k,
                                                                                slots=other))  # fmt: skip
    # the scorer's own cost (design note, first GPU steps: fusion can reach <= 1.0x only if the
    # scorer without stores is well below DeepGEMM): the dense mode without its stores, at the
    # default shape and with two q-blocks per program (each pool tile read once for both)
    res["triton_nostore_alone_ms"] = do_bench_ms(lambda: ff.scores_probe(q8, wq, k8, ks, starts, ends))
    if H < 128:  # (H 128 runs two rows per program already: N = 256, the widest wgmma)
        res["triton_nostore_kv2_alone_ms"] = do_bench_ms(lambda: ff.scores_probe(q8, wq, k8, ks, starts, ends,
                                                                                 block_q=2 * (128 // H)))  # fmt: skip
    _, emitted = ff.score_select(q8, wq, k8, ks, starts, ends, k)
    res["candidates_mean"] = float(emitted.float().mean())
    res["candidates_max"] = int(emitted.max())
    res["visible_mean"] = float((ends - starts).float().mean())
    if case == "W":  # recency bias: later pools score higher
        rising = ks * (1 + 3 * torch.arange(ks.numel(), device="cuda") / ks.numel())
        res["recency_fused_alone_ms"] = do_bench_ms(lambda: ff.score_select(q8, wq, k8, rising, starts, ends, k))
        _, em = ff.score_select(q8, wq, k8, rising, starts, ends, k)
        res["recency_candidates_mean"] = float(em.float().mean())
        res["recency_candidates_max"] = int(em.max())
    # the Triton selector alone on DeepGEMM's logits of these rows: step 0 (rows that see at
    # most k pools select them all without ranking) on and off, the same ids
    from ..kernels.triton_topk import topk_ascending

    if dg:
        logits = deep_gemm.fp8_mqa_logits(q8, (k8, ks), wq, starts, ends, clean_logits=False)[:, : k8.shape[0]]
    else:
        logits = ff.score_select(q8, wq, k8, ks, starts, ends, k, dense=True, fill=None)
    base = torch.full((logits.shape[0],), lo, dtype=torch.int64, device="cuda")
    a = topk_ascending(logits, starts, ends, base, k)
    b = topk_ascending(logits, starts, ends, base, k, short_rows=False)
    res["select_short_rows_equal"] = bool(torch.equal(a, b))
    res["select_alone_ms"] = do_bench_ms(lambda: topk_ascending(logits, starts, ends, base, k))
    res["select_alone_no_short_rows_ms"] = do_bench_ms(lambda: topk_ascending(logits, starts, ends, base, k,
                                                                              short_rows=False))  # fmt: skip
    res["rows_short"] = int(((ends - starts) <= k).sum())
    del logits, a, b
    for key in ("whole_dense_ms", "whole_fused_ms", "triton_dense_alone_ms", "triton_fused_alone_ms",
                f"triton_fused_{other}_alone_ms", "triton_nostore_alone_ms", "triton_nostore_kv2_alone_ms"):
        if dg and key in res:
            res[key.replace("_ms", "_over_deepgemm")] = res[key] / res["deepgemm_alone_ms"]
    res["whole_dense_over_scorer"] = res["whole_dense_ms"] / res["deepgemm_alone_ms" if dg else "triton_dense_alone_ms"]
    res["wall_s"] = time.perf_counter() - t0
    return res


def w_inputs(H: int, topk: int = 2048):
    """W's prepared FP8 inputs for the kernels alone: every row of the slice in one call."""
    return prepared(slice_problem("W", H, topk, max_logits_bytes=2 * 2**30))[:6]


def sweep(H: int, configs: list[dict], caps: list[tuple[int, int]], k: int = 512) -> list[dict]:
    """The kernel alone on W's inputs for each launch ``config``: dense-mode time, whether every
    in-range logit equals DeepGEMM's bit for bit, registers and spills; then the fused mode of
    the fastest exact config with each candidate capacity in ``caps``."""
    import deep_gemm

    from ..kernels import triton_fp8_fused as ff

    q8, wq, k8, ks, starts, ends = w_inputs(H)
    ref = deep_gemm.fp8_mqa_logits(q8, (k8, ks), wq, starts, ends, clean_logits=False)[:, : k8.shape[0]]
    cols = torch.arange(k8.shape[0], device="cuda")
    vis = (cols[None] >= starts[:, None].long()) & (cols[None] < ends[:, None].long())
    ref_bits = ref[vis].view(torch.int32)
    del ref
    out = [{"H": H, "deepgemm_alone_ms": do_bench_ms(lambda: deep_gemm.fp8_mqa_logits(q8, (k8, ks), wq, starts, ends,
                                                                                        clean_logits=False))}]  # fmt: skip
    best = None
    for cfg in configs:
        cfg = dict(cfg, block_q=cfg["block_q"] if cfg["block_q"] else 128 // H)
        r = {"H": H, **cfg}
        try:
            got = ff.score_select(q8, wq, k8, ks, starts, ends, k, dense=True, **cfg)
            r["bitwise_deepgemm"] = bool(torch.equal(got[vis].view(torch.int32), ref_bits))
            del got
            kern = ff.compiled[(H, cfg["block_q"], cfg["block_p"], True, cfg["one_dot"], torch.float8_e4m3fn)]
            r["regs"], r["spills"] = kern.n_regs, kern.n_spills
            ptx = kern.asm["ptx"]
            r["wgmma"] = "wgmma.mma_async" in ptx and "mma.sync" not in ptx.replace("wgmma.mma_async.sync", "")
            r["dense_ms"] = do_bench_ms(lambda: ff.score_select(q8, wq, k8, ks, starts, ends, k, dense=True, **cfg))
            r["dense_over_deepgemm"] = r["dense_ms"] / out[0]["deepgemm_alone_ms"]
            if r["bitwise_deepgemm"] and (best is None or r["dense_ms"] < best[1]):
                best = (cfg, r["dense_ms"])
        except Exception as exc:
            r["error"] = f"{type(exc).__name__}: {exc}"[:400]
        log(r)
        out.append(r)
        torch.cuda.empty_cache()
    if best is not None:
        for cap, check in caps:
            cfg = dict(best[0], cap=cap or None, check=check)
            r = {"H": H, "fused": True, **cfg}
            try:
                r["fused_ms"] = do_bench_ms(lambda: ff.score_select(q8, wq, k8, ks, starts, ends, k, **cfg))
                _, em = ff.score_select(q8, wq, k8, ks, starts, ends, k, **cfg)
                r["candidates_mean"], r["candidates_max"] = float(em.float().mean()), int(em.max())
                r["fused_over_deepgemm"] = r["fused_ms"] / out[0]["deepgemm_alone_ms"]
            except Exception as exc:
                r["error"] = f"{type(exc).__name__}: {exc}"[:400]
            log(r)
            out.append(r)
    return out


#: Launch shapes timed by ``--sweep`` (on 2026-12-04 the first was the fastest exact one at
#: H 32 and 64: ``benchmarks/results/h200-cu130-torch2.11/README.md``).
SWEEP = [dict(one_dot=True, block_q=0, block_p=64, num_warps=4, num_stages=3),
         dict(one_dot=True, block_q=0, block_p=64, num_warps=4, num_stages=4),
         dict(one_dot=True, block_q=0, block_p=64, num_warps=4, num_stages=2),
         dict(one_dot=True, block_q=0, block_p=128, num_warps=8, num_stages=3),
         dict(one_dot=False, block_q=4, block_p=64, num_warps=4, num_stages=3)]  # fmt: skip


def main(argv=None) -> int:
    ap = parser("fused", __doc__)
    ap.add_argument("--heads", default="32,64,128")
    ap.add_argument("--cases", default="W,packed64,W262k")
    ap.add_argument("--topk", default="2048", help="comma-separated topk values (tokens), e.g. 2048,8192")
    ap.add_argument("--out", default=".")
    ap.add_argument("--sweep", action="store_true", help="time the kernel's launch shapes on W instead (bench_fused_sweep.json)")
    ap.add_argument("--caps", default="0:8,0:4,0:16,4096:8",
                    help="candidate capacity:check pairs timed with --sweep (capacity 0: the default)")
    args = ap.parse_args(argv)
    caps = [tuple(int(v) for v in c.split(":")) for c in args.caps.split(",")]
    require_cuda("fused")
    doc = {"environment": environment(command_line("fused", argv), packages=("triton", "tilelang", "deep_gemm",
                                                                            "lmdeploy")),
           "args": vars(args), "results": []}  # fmt: skip
    if args.sweep:
        for H in map(int, args.heads.split(",")):
            doc["results"] += sweep(H, SWEEP, caps)
            save(doc, args.out, "bench_fused_sweep.json")
        return 0
    for case in args.cases.split(","):
        for topk in map(int, args.topk.split(",")):
            for H in map(int, args.heads.split(",")):
                try:
                    r = one(case, H, topk)
                except Exception as exc:  # record and go on: one unsupported shape must not lose the rest
                    r = {"case": case, "H": H, "topk": topk, "error": f"{type(exc).__name__}: {exc}"[:600]}
                log(r)
                doc["results"].append(r)
                save(doc, args.out, "bench_fused.json")
    return 0
