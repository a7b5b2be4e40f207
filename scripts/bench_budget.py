"""The whole call against the logits budget: time, peak memory, chunks, and the ratio to the
scorer alone, in one run.

    python scripts/bench_budget.py [--cases W,Wrecency,W262k,packed64] [--heads 32,64] [--topk 2048]
        [--budgets 2048,1024,768,512] [--precisions fp8,bf16] [--out DIR]

Cases as ``scripts/bench_fused.py`` (rank 3 of a 4-rank split, D 128, kpool 4), plus
``Wrecency``: W with every key scaled by ``1 + 3 t / S`` along the sequence (``t`` the token,
``S`` the length), so later pools score higher and the selector's thresholds sit elsewhere
than on W's random scores. For each case, arithmetic (``fp8``: the deepgemm backend;
``bf16``: tilelang), H, topk and logits budget (``--budgets``, MiB per scoring chunk): the
whole call (``sp_kpool.pipeline.solve``, the dense path) by ``triton.testing.do_bench``, its
peak extra device memory (``torch.cuda.max_memory_allocated`` above what was allocated
before, the output included), the chunks, and whether its ids equal those of the first
budget. ``fp8`` at H 32 and 64 also times DeepGEMM ``fp8_mqa_logits`` alone on the same
prepared inputs (all rows in one call, ``clean_logits=False``) and gives each whole call's
ratio to it. Writes ``bench_budget.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time

import torch

from bench_fused import CASES, peak_mb, prepared
from sp_kpool.agreement import num_pools, scoring_chunk_rows
from sp_kpool.backends import BACKENDS
from sp_kpool.pipeline import solve
from sp_kpool.testing.bench_timing import do_bench_ms, log, package_versions, save
from sp_kpool.testing.problems import rank_slice_problem

BACKEND = {"fp8": "deepgemm", "bf16": "tilelang"}


def problem(case: str, precision: str, H: int, topk: int):
    """The case's problem (``Wrecency``: W's, keys rising along the sequence)."""
    total, lengths = CASES["W" if case == "Wrecency" else case]
    p = rank_slice_problem(total, 4, 3, heads=H, head_dim=128, topk=topk, precision=precision, lengths=lengths,
                           device="cuda")  # fmt: skip
    if case == "Wrecency":
        S = p.k.shape[0]
        ramp = 1 + 3 * torch.arange(S, device="cuda", dtype=torch.float32) / S
        p = dataclasses.replace(p, k=(p.k.float() * ramp[:, None]).to(p.k.dtype))
    return p


def one(case: str, precision: str, H: int, topk: int, budgets: list[int]) -> list[dict]:
    base = problem(case, precision, H, topk)
    name = BACKEND[precision]
    be = BACKENDS[name]
    out, first = [], None
    scorer_ms = None
    if precision == "fp8" and H in be.deepgemm_heads:
        import deep_gemm

        q8, wq, k8, ks, starts, ends, _ = prepared(base)
        scorer_ms = do_bench_ms(lambda: deep_gemm.fp8_mqa_logits(q8, (k8, ks), wq, starts, ends, clean_logits=False))
        del q8, wq, k8, ks, starts, ends
    for mib in budgets:
        p = dataclasses.replace(base, config=dataclasses.replace(base.config, max_logits_bytes=mib * 2**20))
        r = {"case": case, "precision": precision, "backend": name, "H": H, "topk": topk, "budget_mib": mib,
             "rows": p.seq.shard_size}  # fmt: skip
        rows = min(p.seq.shard_end, p.seq.num_real_tokens) - p.seq.shard_start
        C = scoring_chunk_rows(be, p, num_pools(p.seq, p.kpool))
        r["chunk_rows"], r["chunks"] = C, math.ceil(rows / C)
        ids = solve(p, name).ids
        if first is None:
            first = ids
        r["ids_equal_first_budget"] = bool(torch.equal(ids, first))
        del ids
        r["whole_ms"] = do_bench_ms(lambda: solve(p, name))
        r["peak_extra_mib"] = peak_mb(lambda: solve(p, name))
        if scorer_ms is not None:
            r["deepgemm_alone_ms"] = scorer_ms
            r["whole_over_deepgemm"] = r["whole_ms"] / scorer_ms
        log(r)
        out.append(r)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="W,Wrecency,W262k,packed64")
    ap.add_argument("--precisions", default="fp8,bf16")
    ap.add_argument("--heads", default="32,64")
    ap.add_argument("--topk", default="2048")
    ap.add_argument("--budgets", default="2048,1024,768,512", help="logits budgets in MiB, the first the reference")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    doc = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "versions": package_versions(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "results": []}  # fmt: skip
    for case in args.cases.split(","):
        for precision in args.precisions.split(","):
            for topk in map(int, args.topk.split(",")):
                for H in map(int, args.heads.split(",")):
                    try:
                        doc["results"] += one(case, precision, H, topk, budgets)
                    except Exception as exc:  # record and go on: one unsupported shape must not lose the rest
                        r = {"case": case, "precision": precision, "H": H, "topk": topk,
                             "error": f"{type(exc).__name__}: {exc}"[:600]}  # fmt: skip
                        log(r)
                        doc["results"].append(r)
                    save(doc, args.out, "bench_budget.json")
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
