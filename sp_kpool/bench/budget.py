"""The whole call against the logits budget: time, peak memory, chunks, and the ratio to the
scorer alone, in one run.

    python -m sp_kpool.bench budget [--cases W,Wrecency,W262k,packed64] [--heads 32,64] [--topk 2048]
        [--budgets 2048,1024,768,512] [--arms fp8:deepgemm,bf16:triton,bf16:tilelang] [--out DIR]

Cases as the ``fused`` case's (rank 3 of a 4-rank split, D 128, kpool 4), plus
``Wrecency``: W with every key scaled by ``1 + 3 t / S`` along the sequence (``t`` the token,
``S`` the length), so later pools score higher and the selector's thresholds sit elsewhere
than on W's random scores (:func:`sp_kpool.bench.inputs.slice_problem`). For each case, arm (``precision:backend``; ``backend+cuda``: its
chunks scored by the CUDA scorer, ``Settings.cuda_scorer``), H, topk and logits
budget (``--budgets``, MiB per scoring chunk): the whole call (``sp_kpool.pipeline.solve``,
the dense path) by ``triton.testing.do_bench``, its peak extra device memory
(``torch.cuda.max_memory_allocated`` above what was allocated before, the output included),
the chunks, and whether its ids equal those of the first budget; an arm after the first of
its precision also counts the rows whose ids differ from the first arm's (another scorer
order: near-ties). The scorer alone on the same prepared inputs (all rows in one call), in
the same run: ``fp8`` at H 32 and 64 DeepGEMM ``fp8_mqa_logits`` (``clean_logits=False``),
the BF16 arms the TileLang scorer (``clean=False``, when tilelang is installed); each whole
call's ratio to it. Writes ``bench_budget.json``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..agreement import num_pools, scoring_chunk_rows
from ..backends import BACKENDS
from ..pipeline import solve
from .inputs import prepared, slice_problem
from .record import command_line, environment, log, parser, require_cuda, save
from .timing import do_bench_ms, peak_mb

ARMS = "fp8:deepgemm,bf16:triton,bf16:tilelang"


def scorer_alone_ms(base, precision: str):
    """``(name, ms)`` of the scorer alone on ``base``'s prepared rows (all in one call), or
    ``(None, None)``: DeepGEMM for ``fp8`` at H 32 / 64, TileLang for the BF16 arms (the
    ``triton`` backend's prepared rows: the same pools, the weights folded as TileLang's)."""
    if precision == "fp8":
        if base.heads not in BACKENDS["deepgemm"].deepgemm_heads:
            return None, None
        import deep_gemm

        q8, wq, k8, ks, starts, ends, _ = prepared(base)
        return "deepgemm", do_bench_ms(lambda: deep_gemm.fp8_mqa_logits(q8, (k8, ks), wq, starts, ends,
                                                                        clean_logits=False))  # fmt: skip
    if BACKENDS["tilelang"].not_supported_reasons(base):
        return None, None
    from ..kernels.tilelang_score import tilelang_scores

    q, wq, keys, _, starts, ends, _ = prepared(base, "triton")
    return "tilelang", do_bench_ms(lambda: tilelang_scores(q, wq, keys, starts, ends, clean=False))


def one(case: str, arms: list[tuple[str, str]], H: int, topk: int, budgets: list[int]) -> list[dict]:
    out, first_of, alone = [], {}, {}  # alone: the scorer alone per precision (the BF16 arms share TileLang's)
    for precision, arm in arms:
        name, cuda = arm.removesuffix("+cuda"), arm.endswith("+cuda")
        base = slice_problem(case, H, topk, precision=precision)
        if cuda:  # the backend with its chunks scored by the CUDA scorer (Settings.cuda_scorer)
            base = dataclasses.replace(base, settings=base.settings.replace(cuda_scorer=True))
        be = BACKENDS[name]
        why = be.not_supported_reasons(base)
        if why:
            r = {"case": case, "precision": precision, "backend": arm, "H": H, "topk": topk, "skipped": why}
            log(r)
            out.append(r)
            continue
        if precision not in alone:
            alone[precision] = scorer_alone_ms(base, precision)
        scorer, scorer_ms = alone[precision]
        first = None
        for mib in budgets:
            p = dataclasses.replace(base, config=dataclasses.replace(base.config, max_logits_bytes=mib * 2**20))
            r = {"case": case, "precision": precision, "backend": arm, "H": H, "topk": topk, "budget_mib": mib,
                 "rows": p.seq.shard_size}  # fmt: skip
            rows = min(p.seq.shard_end, p.seq.num_real_tokens) - p.seq.shard_start
            C = scoring_chunk_rows(be, p, num_pools(p.seq, p.kpool))
            r["chunk_rows"], r["chunks"] = C, math.ceil(rows / C)
            ids = solve(p, name).ids
            if first is None:
                first = ids
                if precision in first_of:  # another backend of this arithmetic ran first
                    other, ids0 = first_of[precision]
                    r[f"rows_differing_from_{other}"] = int((ids.sort(1).values != ids0.sort(1).values).any(1).sum())
                else:
                    first_of[precision] = (arm, ids)
            r["ids_equal_first_budget"] = bool(torch.equal(ids, first))
            del ids
            r["whole_ms"] = do_bench_ms(lambda: solve(p, name))
            r["peak_extra_mib"] = peak_mb(lambda: solve(p, name))
            if scorer_ms is not None:
                r[f"{scorer}_alone_ms"] = scorer_ms
                r[f"whole_over_{scorer}"] = r["whole_ms"] / scorer_ms
            log(r)
            out.append(r)
        del first, base
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = parser("budget", __doc__)
    ap.add_argument("--cases", default="W,Wrecency,W262k,packed64")
    ap.add_argument("--arms", default=ARMS, help="precision:backend pairs")
    ap.add_argument("--heads", default="32,64")
    ap.add_argument("--topk", default="2048")
    ap.add_argument("--budgets", default="2048,1024,768,512", help="logits budgets in MiB, the first the reference")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",")]
    arms = [tuple(a.split(":")) for a in args.arms.split(",")]
    for a in arms:
        name = a[1].removesuffix("+cuda") if len(a) == 2 else None
        if len(a) != 2 or name not in BACKENDS or a[0] not in BACKENDS[name].precisions:
            ap.error(f"--arms: expected precision:backend pairs a backend implements, the backend optionally "
                     f"+cuda ({', '.join(f'{p}:{n}' for n, b in BACKENDS.items() for p in b.precisions)}), "
                     f"got {':'.join(a)!r}")  # fmt: skip
    require_cuda("budget")
    doc = {"environment": environment(command_line("budget", argv), packages=("triton", "tilelang", "deep_gemm",
                                                                             "lmdeploy")),
           "args": vars(args), "results": []}  # fmt: skip
    for case in args.cases.split(","):
        for topk in map(int, args.topk.split(",")):
            for H in map(int, args.heads.split(",")):
                try:
                    doc["results"] += one(case, arms, H, topk, budgets)
                except Exception as exc:  # record and go on: one unsupported shape must not lose the rest
                    r = {"case": case, "arms": args.arms, "H": H, "topk": topk,
                         "error": f"{type(exc).__name__}: {exc}"[:600]}  # fmt: skip
                    log(r)
                    doc["results"].append(r)
                save(doc, args.out, "bench_budget.json")
                torch.cuda.empty_cache()
    return 0
