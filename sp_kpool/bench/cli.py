"""The dispatcher of ``python -m sp_kpool.bench CASE [options]``: :data:`CASES` (each case's
module, whether it needs CUDA, one line on what it measures) and :func:`main`."""

from __future__ import annotations

__all__ = ["CASES", "usage", "main"]

#: case -> (module under sp_kpool.bench, needs CUDA, one line)
CASES = {
    "e2e": ("e2e", False, "kpool_topk end to end per backend, precision, gather, balance and layout (ranks)"),
    "report": ("report", False, "re-draw or merge e2e records: table, plot, balance work model fit"),
    "replay": ("replay", False, "replay.shard against torch.sort of its capture; the cost of uncovered rows"),
    "train": ("train", False, "the indexer's KL loss (sparse, dense) against one kpool_topk call, peak memory"),
    "kernels": ("kernels", True, "the GPU backends' stages on the reference slice, DeepGEMM alone, selectors"),
    "select": ("selector", True, "the Triton Top-K selector's launches against the exact Top-K, torch, LMDeploy"),
    "fused": ("fused", True, "the fused FP8 path against the dense one and DeepGEMM alone (--sweep: launches)"),
    "cuda-scorer": ("cuda_scorer", True, "the CUDA scorer against DeepGEMM (FP8) and the Triton scorer (BF16)"),
    "budget": ("budget", True, "whole calls against the logits budget: time, peak memory, chunks"),
    "check-finite": ("check_finite", True, "the cost of check_finite=True (the check alone, whole calls)"),
    "host": ("host", True, "host time of each pipeline step while the device is busy"),
    "profile": ("profiler", True, "torch.profiler tables and the GPU timeline of one call"),
    "ncu-select": ("ncu_select", True, "three Triton selector launches for Nsight Compute, nothing timed"),
}


def _module(case: str):
    """The module of ``case`` (imported here: ``import sp_kpool.bench`` imports no case)."""
    from . import (budget, check_finite, cuda_scorer, e2e, fused, host, kernels, ncu_select, profiler, replay, report,
                   selector, train)  # fmt: skip

    modules = (budget, check_finite, cuda_scorer, e2e, fused, host, kernels, ncu_select, profiler, replay, report,
               selector, train)  # fmt: skip
    return {m.__name__.rsplit(".", 1)[1]: m for m in modules}[CASES[case][0]]


def usage() -> str:
    lines = ["usage: python -m sp_kpool.bench CASE [options]   (CASE --help: its options)", "", "cases:"]
    lines += [f"  {c:<13} {'GPU ' if gpu else 'CPU+'} {text}" for c, (_, gpu, text) in CASES.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run ``argv[0]``'s case with the rest of ``argv`` (default: this process's arguments)."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(usage())
        return 0
    case, rest = argv[0], argv[1:]
    if case not in CASES:
        print(f"unknown case: {case!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return _module(case).main(rest) or 0
