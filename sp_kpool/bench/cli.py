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
    """The module of ``case`` (imported here, so a CPU run never imports the GPU cases)."""
    name = CASES[case][0]
    if name == "e2e":
        from . import e2e as m
    elif name == "report":
        from . import report as m
    elif name == "replay":
        from . import replay as m
    elif name == "train":
        from . import train as m
    elif name == "kernels":
        from . import kernels as m
    elif name == "selector":
        from . import selector as m
    elif name == "fused":
        from . import fused as m
    elif name == "cuda_scorer":
        from . import cuda_scorer as m
    elif name == "budget":
        from . import budget as m
    elif name == "check_finite":
        from . import check_finite as m
    elif name == "host":
        from . import host as m
    elif name == "profiler":
        from . import profiler as m
    else:
        from . import ncu_select as m
    return m


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
