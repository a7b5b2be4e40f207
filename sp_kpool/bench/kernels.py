"""Single-GPU benchmark of the GPU backends on the reference workload (docs/measurements.md).

    python -m sp_kpool.bench kernels [--heads 32,64] [--total 131072] [--out DIR]

Workload: the rank-3 slice of a 4-rank split of one ``--total``-token document (for 131072:
32768 queries at positions 98304..131071 against 32768 pools), D 128, topk 2048, kpool 4.
Reports, measured in the same run: the BF16 and FP8 matrix-product ceilings of this GPU;
per stage (pool, score, select, expand) times of the tilelang and triton (bf16) and deepgemm
(fp8) backends (the whole call: the pipeline's stages after the gather, ``sp_kpool.pipeline.solve``,
repeated on one sequence, so its table cache is warm, as for every layer after the first;
also with the cache off, ``whole_table_cache_off``) with achieved TFLOP/s
(causal query-pool pairs only) and the fraction of the ceiling; DeepGEMM scoring alone
(with and without its -inf cleaning of the cells outside the row ranges); torch.topk,
LMDeploy's selector and the Triton exact selector on the same logits; the torch backend
end to end (twice, the faster counts) for the speed-up; with ``--arms fused``, the fused FP8
path against the dense one and DeepGEMM alone (the ``fused`` case's measurements of
this workload). Writes ``bench_kernels.json``.

The whole call is timed three ways: synchronized before every call ("cold": the device
waits for the host's work before the first kernel), with the host ahead of the device (a
sleep queued first, so the host's work overlaps it) and by ``triton.testing.do_bench``
(calls queued back to back after an L2 flush: the host runs ahead too, as in a model's
forward pass). The device idles during the sleep: on an H200 the host-ahead time of the
H 32 call was 0.3-0.5 ms below the time of calls queued back to back
(``benchmarks/results/h200-cu130-torch2.11/README.md``), so ``do_bench`` is the
steady-state figure.
DeepGEMM alone is timed cold and by ``do_bench``; the JSON holds the ratios of each pair.
The timing helpers live in :mod:`sp_kpool.bench.timing`.
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch

from ..backends import BACKENDS
from ..backends.base import fold_bf16_weights
from ..pipeline import RunRecord, solve
from ..pooling import pool_table
from ..selection import row_meta
from ..testing.problems import rank_slice_problem, reference_slice_problem
from .record import command_line, environment, launch_kwargs, log, parser, require_cuda, save
from .timing import ceilings
from .timing import do_bench_ms as bench_do_bench
from .timing import host_ahead_ms as bench_host_ahead
from .timing import median_ms as bench


def causal_pairs(p):
    starts, offs = pool_table(p.seq.real_cu_seq_lens, p.kpool)
    m = row_meta(torch.arange(p.seq.shard_start, min(p.seq.shard_end, p.seq.num_real_tokens)), p.seq.real_cu_seq_lens, offs, p.kpool)
    return int(m.n_visible.sum())


def staged(name, p, reps=5):
    """The whole call (pipeline stages 3-8 on the gathered problem, :func:`solve`) of backend
    ``name``: median ms, and the medians of its stages and of the other timings."""

    def run(problem=p, record=None):
        return solve(problem, name, record)

    run()  # warm-up (JIT)
    torch.cuda.synchronize()
    stages: dict = {}
    for _ in range(reps):
        rec = RunRecord(stage_times={})
        run(p, rec)
        for k, v in rec.stage_times.items():
            stages.setdefault(k, []).append(v * 1e3)
    whole = bench(run, reps=reps, warmup=1)
    med = {k: sorted(v)[len(v) // 2] for k, v in stages.items()}
    med["whole_host_ahead"], med["host_call_while_device_busy"] = bench_host_ahead(run, reps=reps)
    med["whole_do_bench"] = bench_do_bench(run)
    # "whole" repeats the call on one sequence, so its table cache is warm (as for every
    # layer of a step after the first); the same call building its tables every time:
    uncached = dataclasses.replace(p, settings=p.settings.replace(table_cache=False))
    med["whole_table_cache_off"] = bench(lambda: run(uncached), reps=reps, warmup=1)
    return whole, med


def deepgemm_chunked(p, fn, q8, wq, kv):
    """DeepGEMM alone, as the pipeline calls it: the same chunks and calls
    (:func:`sp_kpool.plan.plan_chunks`, :func:`sp_kpool.scoring.chunk_calls` of the rows
    ``q8``/``wq`` of the shard), the same kv slices (inputs built outside the timing),
    ``clean_logits=False``."""
    from sp_kpool.agreement import call_of
    from sp_kpool.backends.base import Queries
    from sp_kpool.config import RunOptions
    from sp_kpool.plan import pad_rows, plan_chunks
    from sp_kpool.scoring import chunk_calls

    be = BACKENDS["deepgemm"]
    seq = p.seq
    lo_row, hi_row = seq.shard_start, min(seq.shard_end, seq.num_real_tokens)
    C = call_of(p, RunOptions(backend="deepgemm")).chunk
    plan = plan_chunks(seq, p.kpool, C, lo_row, hi_row, p.device, cache=False, row_local=be.row_local_scores)
    before, after = plan.padding()
    calls = []
    queries = Queries(pad_rows(q8, before, after), pad_rows(wq, before, after), lo_row - before)
    for call in chunk_calls(plan, queries):
        c = call.chunk
        shift = c.pool_lo % 4  # as DeepGemmBackend.score: kv slices start at a multiple of 4 pools
        calls.append((call.q, (kv[0][c.pool_lo - shift : c.pool_hi], kv[1][c.pool_lo - shift : c.pool_hi]), call.w,
                      call.starts + shift, call.ends + shift))  # fmt: skip

    def run():
        for c in calls:
            fn(*c, clean_logits=False)

    return bench(run, reps=5)


def tune(args):
    """Time the TileLang scorer alone on the whole slice for each config."""
    from sp_kpool.kernels.tilelang_score import tilelang_scores

    rows = []
    for H in [int(h) for h in args.heads.split(",")]:
        p = rank_slice_problem(args.total, 4, 3, heads=H, head_dim=128, topk=2048, seed=H)
        st, offs = pool_table(p.seq.real_cu_seq_lens, 4)
        pooled = BACKENDS["tilelang"].pools(p, st.cuda()).keys
        m = row_meta(torch.arange(p.seq.shard_start, p.seq.shard_end), p.seq.real_cu_seq_lens, offs, 4)
        s, e = m.pool_lo.int().cuda(), m.pool_hi.int().cuda()
        w = fold_bf16_weights(p.head_weights, H, 128)
        flops = 2.0 * causal_pairs(p) * H * 128
        for cfg in args.tune.split(","):
            c = tuple(int(v) for v in cfg.split(":"))
            clean = bool(c[4]) if len(c) > 4 else True  # 5th field 0: no -inf fill and masking
            try:
                ms = bench(lambda: tilelang_scores(p.q, w, pooled, s, e, config=c[:4], clean=clean), reps=5, warmup=1)
                row = {"H": H, "config": cfg, "ms": ms, "tflops": flops / ms / 1e9}
            except Exception as exc:  # noqa: BLE001
                row = {"H": H, "config": cfg, "error": f"{type(exc).__name__}: {str(exc)[-300:]}"}
            rows.append(row)
            log(json.dumps(row))
        torch.cuda.empty_cache()
    return rows


#: ``--arms`` names: (arm, precision, backend)
ARMS = (("bf16", "bf16", "tilelang"), ("bf16-triton", "bf16", "triton"), ("fp8", "fp8", "deepgemm"))


def main(argv=None) -> int:
    ap = parser("kernels", __doc__)
    ap.add_argument("--heads", default="32,64")
    ap.add_argument("--total", type=int, default=131072)
    ap.add_argument("--budget", type=int, default=0, help="max_logits_bytes for the GPU backends (0: the library default)")
    ap.add_argument("--torch-baseline", action="store_true", help="also time the torch backend end to end (slow)")
    ap.add_argument("--arms", default="bf16,bf16-triton,fp8",
                    help="which of bf16 (tilelang), bf16-triton (triton), fp8 (deepgemm) and fused (the fused FP8 path "
                         "against the dense one and DeepGEMM alone: the fused case's measurements of this "
                         "workload) to run")
    ap.add_argument("--tune", default="", help="tilelang configs 'bn:stages:threads[:bq[:clean]],...' to time first")
    ap.add_argument("--select-configs", default="",
                    help="selector launches 'name=value[+name=value]' (keyword arguments of topk_ascending: capg, ways, "
                         "maxnreg, vsteps, ...), comma-separated, timed on the fp8 logits after the default launch and "
                         "compared with its answer (a repeated launch is timed again)")
    ap.add_argument("--prompt-fraction", type=float, default=0.0,
                    help="that fraction of the document is its prompt: its pools are compressed in the extend "
                         "order (the serving compression schedule); default 0: all decode")  # fmt: skip
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.arms.split(",")) - {a for a, _, _ in ARMS} - {"fused"})
    if unknown:
        ap.error(f"--arms: expected names from {[a for a, _, _ in ARMS] + ['fused']}, got {unknown}")
    require_cuda("kernels")
    res = {"environment": environment(command_line("kernels", argv), packages=("triton", "tilelang", "deep_gemm",
                                                                              "lmdeploy")),
           "args": vars(args)}  # fmt: skip
    res["ceilings"] = ceil = ceilings(torch.device("cuda"), reps=20)
    log(json.dumps(res))
    res["runs"] = []
    if args.tune:
        res["tune"] = tune(args)
    if "fused" in args.arms.split(","):
        # the fused FP8 path on this workload (rank 3 of 4 of one --total-token document):
        # fused, unfused and DeepGEMM alone, their ratios, candidates per row, overflow rows
        # (the selector's counter) and peak memory, as the fused case
        from .fused import one as fused_one

        res["fused"] = []
        for H in [int(h) for h in args.heads.split(",")]:
            try:
                r = fused_one(f"slice{args.total}", H, 2048, total=args.total)
            except Exception as exc:  # noqa: BLE001
                r = {"H": H, "error": f"{type(exc).__name__}: {exc}"[:600]}
            log(json.dumps(r))
            res["fused"].append(r)
    for H in [int(h) for h in args.heads.split(",")]:
        base = {}  # per H: the torch backend's time (the BF16 arms share it)
        for arm, precision, name in ARMS:
            if arm not in args.arms.split(","):
                continue
            p = reference_slice_problem(H, precision, total=args.total, seed=H, max_logits_bytes=args.budget or None,
                                        prompt_fraction=args.prompt_fraction)  # fmt: skip
            pairs = causal_pairs(p)
            flops = 2.0 * pairs * H * 128
            row = {"backend": name, "precision": precision, "H": H, "rows": p.q.shape[0], "causal_pairs": pairs}
            try:
                whole, st = staged(name, p)
                ceiling = ceil["bf16_matmul_tflops"] if precision == "bf16" else ceil.get("fp8_matmul_tflops")
                row.update(whole_ms=whole, stages_ms=st, score_tflops=flops / st["score"] / 1e9,
                           whole_over_score=whole / st["score"])  # fmt: skip
                if isinstance(ceiling, float):
                    row["score_fraction_of_ceiling"] = row["score_tflops"] / ceiling
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {exc}"
            if precision == "fp8" and "error" not in row:
                # DeepGEMM scoring alone on the same inputs, one call over all rows
                from sp_kpool.backends.deepgemm_backend import mqa_api
                from sp_kpool.kernels.triton_serving import pools_serving, queries_fp8

                fn, _ = mqa_api()
                stt, offs = pool_table(p.seq.real_cu_seq_lens, 4)
                k8, ks = pools_serving(p.k, p.gates, p.ape, stt.cuda(), fp8=True)
                q8, wq = queries_fp8(p.q, p.head_weights)
                m = row_meta(torch.arange(p.seq.shard_start, p.seq.shard_end), p.seq.real_cu_seq_lens, offs, 4)
                s, e = m.pool_lo.int().cuda(), m.pool_hi.int().cuda()
                ms = bench(lambda: fn(q8, (k8, ks), wq, s, e, clean_logits=True), reps=10)
                row["deepgemm_alone_ms"] = ms
                row["deepgemm_alone_tflops"] = flops / ms / 1e9
                row["whole_over_deepgemm_alone"] = row["whole_ms"] / ms
                # the kernel as the indexer calls it when the Triton selector reads the row
                # ranges itself (no -inf cleaning pass)
                ms = bench(lambda: fn(q8, (k8, ks), wq, s, e, clean_logits=False), reps=10)
                row["deepgemm_alone_noclean_ms"] = ms
                row["whole_over_deepgemm_alone_noclean"] = row["whole_ms"] / ms
                # the same ratios with the host ahead of the device (a sleep queued before
                # the whole call; DeepGEMM alone has one host call, timed as above) and
                # both sides by triton.testing.do_bench
                ahead = row["stages_ms"]["whole_host_ahead"]
                row["whole_host_ahead_over_deepgemm_alone"] = ahead / row["deepgemm_alone_ms"]
                row["whole_host_ahead_over_deepgemm_alone_noclean"] = ahead / ms
                for clean in (True, False):
                    name = "deepgemm_alone_do_bench_ms" if clean else "deepgemm_alone_noclean_do_bench_ms"
                    row[name] = bench_do_bench(lambda: fn(q8, (k8, ks), wq, s, e, clean_logits=clean))  # noqa: B023
                    row[name.replace("deepgemm_alone", "whole_over_deepgemm_alone").replace("_ms", "")] = (
                        row["stages_ms"]["whole_do_bench"] / row[name])  # fmt: skip
                row["deepgemm_chunked_noclean_ms"] = deepgemm_chunked(p, fn, q8, wq, (k8, ks))
                # the query preparation alone (all rows once): the register kernel and the generic one
                row["queries_fp8_ms"] = bench(lambda: queries_fp8(p.q, p.head_weights), reps=10)
                row["queries_fp8_generic_ms"] = bench(lambda: queries_fp8(p.q, p.head_weights, generic=True), reps=10)
                logits = fn(q8, (k8, ks), wq, s, e, clean_logits=True)[:, : k8.shape[0]]
                row["torch_topk_520_ms"] = bench(lambda: torch.topk(logits, 520, dim=-1), reps=5)
                try:
                    from lmdeploy.pytorch.kernels.cuda.sparse_index_topk import (
                        sparse_index_topk,
                    )

                    qlen = torch.ones(logits.shape[0], dtype=torch.int32, device="cuda")
                    kvlen = e.clone()
                    row["lmdeploy_topk_512_ms"] = bench(lambda: sparse_index_topk(logits.contiguous(), qlen, kvlen, 512), reps=5)
                except Exception as exc:  # noqa: BLE001
                    row["lmdeploy_topk_512"] = f"unavailable: {type(exc).__name__}: {exc}"
                from sp_kpool.kernels.triton_topk import topk_ascending

                zero = torch.zeros(logits.shape[0], dtype=torch.int64, device="cuda")
                row["triton_topk_512_ms"] = bench(lambda: topk_ascending(logits, s, e, zero, 512), reps=5)
                if args.select_configs:  # other launches of the selector on the same logits, same answer?
                    ref = topk_ascending(logits, s, e, zero, 512)
                    for cfg in args.select_configs.split(","):
                        kw = launch_kwargs(cfg.split("+"))
                        same = torch.equal(topk_ascending(logits, s, e, zero, 512, **kw), ref)
                        ms = bench(lambda: topk_ascending(logits, s, e, zero, 512, **kw), reps=5)  # noqa: B023
                        runs = row.setdefault("triton_topk_512_configs", {})
                        name = cfg if cfg not in runs else f"{cfg}#{sum(n.split('#')[0] == cfg for n in runs) + 1}"
                        runs[name] = {"ms": ms, "equal_default": same}
                del logits
            if args.torch_baseline and precision == "bf16" and "error" not in row and "torch_ms" not in base:
                runs = []
                for _ in range(2):  # the first call also pays one-time allocations
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    solve(dataclasses.replace(p, config=p.config.replace(max_logits_bytes=4 << 30)), "torch")
                    torch.cuda.synchronize()
                    runs.append((time.perf_counter() - t0) * 1e3)
                base["torch_runs_ms"], base["torch_ms"] = runs, min(runs)
            if "torch_ms" in base and precision == "bf16" and "error" not in row:  # timed once per H
                row["torch_backend_runs_ms"] = base["torch_runs_ms"]
                row["torch_backend_ms"] = base["torch_ms"]
                row["speedup_vs_torch"] = row["torch_backend_ms"] / row["whole_ms"]
            res["runs"].append(row)
            log(json.dumps(row))
            torch.cuda.empty_cache()
    save(res, args.out, "bench_kernels.json")
    return 0
