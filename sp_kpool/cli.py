"""``python -m sp_kpool``: ``info`` (backends and why), ``demo`` (a checked sharded run),
``parity`` (replay a captured indexer call in two arms and compare)."""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["main"]

#: What ``python -m sp_kpool --help`` says (plain text: the module docstring is reST).
DESCRIPTION = ("info (backends and why), demo (a checked sharded run), parity (replay a captured indexer call in "
               "two arms and compare).")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: ...)`` for flags whose default is a value; a flag without one (its
    default ``None``, said in its help) or a switch shows none (not ``(default: None)``)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _int_at_least(minimum: int):
    """An argparse ``type=``: an int >= ``minimum`` (argparse names the flag, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


def _float_in(low: float, high: float | None = None, *, open_low: bool = False):
    """An argparse ``type=``: a finite float in ``[low, high]`` (``(low, ...`` with ``open_low``)."""
    want = f"{'>' if open_low else '>='} {low:g}" + (f" and <= {high:g}" if high is not None else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number {want}, got {text!r}") from None
        ok = (value > low if open_low else value >= low) and (high is None or value <= high) and value < float("inf")
        if not ok:
            raise argparse.ArgumentTypeError(f"expected a number {want}, got {text}")
        return value

    return parse


def _arm(text: str):
    from .parity import Arm

    try:
        return Arm.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _check_operator_flags(parser: argparse.ArgumentParser, args) -> None:
    """Flags that only together make an operator call: ``--topk`` a multiple of
    ``--kpool``, ``--docs`` at most ``--tokens``, ``--rank`` below ``--world-size``."""
    from .config import KPoolConfig

    try:
        KPoolConfig(topk=args.topk, kpool=args.kpool)
    except ValueError as exc:
        parser.error(f"argument --topk: {str(exc).removeprefix('topk: ')}")
    if args.docs > args.tokens:
        parser.error(f"argument --docs: expected at most --tokens = {args.tokens} documents, got {args.docs}")
    rank = getattr(args, "rank", 0)
    if not rank < args.world_size:
        parser.error(f"argument --rank: expected < --world-size = {args.world_size}, got {rank}")


#: What a user chooses per call (``kpool_topk`` keywords, ``ShardedSequence.split(layout=)``)
#: and by switch: one line each for ``info`` (``tests/unit/test_cli_info.py`` checks that every
#: value the package accepts has its line).
CHOICES = {
    "precision": {
        "bf16": "the model definition's arithmetic (FP32 slot softmax, pooled keys in the key dtype)",
        "bf16-serving": "the serving engine's BF16 arithmetic (serving compression of the pools)",
        "fp8": "the serving engine's FP8 arithmetic (E4M3 pools with UE8M0 scales; DeepGEMM's logits on CUDA)",
    },
    "gather": {
        "keys": "all-gather the keys and gates, then pool every rank's history",
        "pools": "pool per shard with a seam exchange, then all-gather the pooled keys (fewer bytes)",
    },
    "balance": {
        "none": "keep the given split of the rows",
        "causal": "move row boundaries so each rank scores about the same causal work",
    },
    "order": {
        "ascending": "selected pools by ascending id",
        "score": "by descending score (ties toward the lower id)",
        "serving": "in the order of the serving selector (LMDeploy's; not deterministic)",
        "ascending-unused-first": "ascending id, unused history slots first (XTuner's canonical order)",
    },
    "tail": {
        "fixed": "history in [0, topk), then the tail",
        "compact": "the tail right after the valid history (as serving lays it out)",
    },
    "layout": {
        "contiguous": "each rank a contiguous block of the packed sequence",
        "zigzag": "each rank two blocks, one from each end (causal work balanced by construction)",
        "zigzag-per-document": "zigzag inside every document",
    },
}

#: Experimental switches, off by default: (variable, one line with its measured result).
EXPERIMENTAL = (
    ("SP_KPOOL_FUSED=1", "fused scoring + selection (triton-fused): same ids, about 1/4 of the memory, "
                         "2.2-2.5x slower on an H200 (benchmarks/results/README.md)"),
    ("SP_KPOOL_CUDA_SCORER=1", "the CUDA scorer (kernels/cuda_fp8_mqa.cu) for deepgemm and triton: same bits; "
                               "not measured on a GPU yet"),
)


def _print_choices() -> None:
    from .backends import backend_names

    print("choices (kpool_topk keywords; ShardedSequence.split(layout=); python -m sp_kpool.bench measures them):")
    print(f"  {'backend=':<11} {', '.join(backend_names())} (which run here: below)")
    for key, values in CHOICES.items():
        for i, (value, line) in enumerate(values.items()):
            print(f"  {key + '=' if i == 0 else '':<11} {value:<23} {line}")
    print("experimental switches (off by default; the record of each: benchmarks/results/README.md):")
    for var, line in EXPERIMENTAL:
        print(f"  {var:<23} {line}")


def _cmd_info(args) -> int:
    import platform

    import torch

    from . import __version__
    from .backends import BACKENDS
    from .backends.base import Problem
    from .config import KPoolConfig
    from .settings import current_settings
    from .sharding import ShardedSequence

    print(f"sp_kpool {__version__}, torch {torch.__version__}, python {platform.python_version()}")
    settings = current_settings()
    if settings.env_error is not None:  # a bad variable: say which (it shows as its default)
        print(f"settings: {settings.env_error}")
    print("settings (read once per process from the environment):")
    for var, value, source in settings.describe():
        print(f"  {var:<28} {value:<40} {source}")
    _print_choices()
    cuda = torch.cuda.is_available()
    print(f"cuda: {torch.cuda.get_device_name(0) if cuda else 'not available'}")
    dev = torch.device("cuda" if cuda else "cpu")
    H, D, K = args.heads, args.head_dim, 4
    seq = ShardedSequence.split([0, 8], world_size=1, rank=0)
    z = torch.zeros
    print(f"backends for H={H}, D={D}, bf16 inputs on {dev}:")
    for b in sorted(BACKENDS.values(), key=lambda b: -b.priority):
        for precision in b.precisions:
            p = Problem(
                q=z(8, H, D, dtype=torch.bfloat16, device=dev), head_weights=z(8, H, device=dev),
                k=z(8, D, dtype=torch.bfloat16, device=dev), gates=z(8, D, device=dev), ape=z(K, D, device=dev),
                seq=seq, config=KPoolConfig(topk=8, kpool=K, precision=precision, max_logits_bytes=1 << 20),
            )  # fmt: skip
            why = b.not_supported_reasons(p)
            state = "available" if not why else "unavailable: " + "; ".join(why)
            print(f"  {b.name:<10} precision={precision:<13} priority={b.priority:<3} {state}")
    from .selectors import describe

    print(f"selectors (k = 512 of 32768 columns, ascending, on {dev}; the first available one runs):")
    for name, kind, summary, why in describe(dev):
        state = "available" if not why else "unavailable: " + "; ".join(why)
        print(f"  {name:<18} {kind:<6} {state}\n  {'':<18} {'':<6} {summary}")
    from ._probe import probe

    print("optional packages:")
    for mod in ("triton", "tilelang", "deep_gemm", "lmdeploy.pytorch.kernels.cuda.sparse_index_topk"):
        m, why = probe(mod)
        print(f"  {mod:<50} {'importable ' + str(getattr(m, '__version__', '')) if m is not None else why}")
    from .backends import deepgemm_api

    print(f"DeepGEMM: {deepgemm_api.describe()}")
    print("  (extras: [fp8] = tokenspeed-deepgemm 2.5.x, no torch pin, imports with torch 2.11; "
          "[fp8-torch214] = 2.8.2, pins torch==2.14.0)")
    return 0


def _cmd_demo(args) -> int:
    from .testing.dist import RanksFailed, run_ranks
    from .testing.problems import random_doc_lengths

    lengths = random_doc_lengths(args.tokens, args.docs, seed=args.seed)
    print(
        f"sp_kpool demo: {args.world_size} gloo ranks ({args.layout} layout), {args.tokens} tokens in {args.docs} "
        f"documents {lengths}, H={args.heads} D={args.head_dim} kpool={args.kpool} topk={args.topk}",
        flush=True,
    )
    t0 = time.perf_counter()
    try:
        with _progress(args.progress_every, "the ranks are still running (each computes its rows and the world-size-1 "
                                            "call)"):  # fmt: skip
            reports = run_ranks(_demo_rank, args.world_size, (lengths, args), timeout=args.timeout)
    except RanksFailed as exc:
        print(f"FAIL: {exc}", file=sys.stderr)
        return 1
    dt = time.perf_counter() - t0
    print(f"{'rank':>4}  {'rows':>19}  {'real rows':>9}  {'selected ids':>12}  equal to world size 1")
    for rep in reports:
        shard = f"[{rep.shard[0]}, {rep.shard[1]})" if rep.shard is not None else rep.layout
        print(f"{rep.rank:>4}  {shard:>19}  {rep.real_rows:>9}  {rep.selected:>12}  {'yes' if rep.equal else 'NO'}")
    ok = all(r.equal for r in reports)
    print(f"{'PASS' if ok else 'FAIL'}: {sum(r.equal for r in reports)}/{len(reports)} ranks bitwise equal ({dt:.1f} s)")
    return 0 if ok else 1


class _progress:
    """A context that prints ``[N s] what`` every ``every`` seconds while its body runs (a
    long demo is not silent)."""

    def __init__(self, every: float, what: str) -> None:
        import threading

        self.every, self.what, self.stop = every, what, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self.stop.wait(self.every):
            print(f"[{time.perf_counter() - t0:.0f} s] {self.what}", flush=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def _demo_rank(rank, world_size, lengths, args):
    from .testing.rank_checks import sharded_vs_world1

    return sharded_vs_world1(
        rank, world_size, lengths, args.kpool, args.topk, heads=args.heads, head_dim=args.head_dim, seed=args.seed,
        layout=args.layout,
    )


def _cmd_parity(args) -> int:
    import tempfile

    from .parity import (
        format_table,
        make_synthetic_capture,
        replay,
        stderr_progress,
        write_outputs,
    )
    from .parity.report import plots_unavailable

    progress = None if args.quiet else stderr_progress
    # Asked before the work, not after it: without matplotlib the JSON and text are written
    # and the plots are skipped, said here and again after the files (exit 0).
    no_plots = None if args.no_plots else plots_unavailable()
    if no_plots is not None:
        print(f"note: the two PNG plots will be skipped: {no_plots}", file=sys.stderr, flush=True)
    try:
        a, b = args.a, args.b
        with tempfile.TemporaryDirectory(prefix="sp_kpool_parity_") as tmp:
            capture = args.capture
            if args.synthetic:
                if capture is not None:
                    raise ValueError(f"CAPTURE: not allowed with --synthetic (it writes its own), got {capture!r}")
                where = args.capture_dir or (f"{args.out}/capture" if args.out else tmp)
                if progress:
                    progress(
                        f"[parity] writing a synthetic capture to {where}: {args.tokens} tokens in {args.docs} "
                        f"document(s), {args.world_size} rank(s), hidden {args.hidden_size}, q_lora_rank "
                        f"{args.q_lora_rank}, H={args.heads} D={args.head_dim} K={args.kpool} T={args.topk}"
                    )
                paths = make_synthetic_capture(
                    where, tokens=args.tokens, docs=args.docs, world_size=args.world_size,
                    hidden_size=args.hidden_size, q_lora_rank=args.q_lora_rank, heads=args.heads,
                    head_dim=args.head_dim, topk=args.topk, kpool=args.kpool, precision=args.capture_precision,
                    backend=args.capture_backend, device=args.device, seed=args.seed,
                    prompt_lens=args.prompt_fraction,
                )  # fmt: skip
                capture = str(paths[args.rank])
            elif capture is None:
                raise ValueError("CAPTURE: expected a capture file (or --synthetic), got none")
            report = replay(capture, a, b, device=args.device, repeat=not args.no_repeat, progress=progress)
        print(format_table(report))
        out = args.out or time.strftime("sp_kpool-parity-%Y%m%d-%H%M%S")
        for p in write_outputs(report, out, plots=not args.no_plots and no_plots is None):
            print(f"wrote {p}")
        if no_plots is not None:
            print(f"skipped the plots: {no_plots}")
        if not args.out:
            print(f"(the files are in {out}/, a new folder of the current directory: --out DIR chooses another)")
    except (ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


_FLAG_HELP = {"world_size": "ranks", "heads": "index heads H", "head_dim": "index head dim D",
              "kpool": "tokens per pool K", "seed": "random seed of the inputs", "topk": "tokens selected per query T",
              "docs": "documents", "tokens": "global length", "hidden_size": "hidden size",
              "q_lora_rank": "q_lora_rank"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; bad flags exit 2 with an argparse error naming the flag."""
    from ._device import device_flag
    from .backends import backend_names
    from .settings import PRECISIONS

    ap = argparse.ArgumentParser(prog="python -m sp_kpool", description=DESCRIPTION)
    sub = ap.add_subparsers(dest="cmd", required=True)
    fmt = {"formatter_class": _HelpFormatter}
    info = sub.add_parser("info", help="print every backend, available or not, and why", **fmt)
    info.add_argument("--heads", type=_int_at_least(1), default=64)
    info.add_argument("--head-dim", type=_int_at_least(1), default=128)
    demo = sub.add_parser("demo", help="a sharded CPU run (gloo) checked against world size 1", **fmt)
    demo.add_argument("--world-size", type=_int_at_least(1), default=4)
    demo.add_argument("--tokens", type=_int_at_least(1), default=4099, help="global length (odd by default)")
    demo.add_argument("--docs", type=_int_at_least(1), default=5, help="documents (at most --tokens)")
    demo.add_argument("--heads", type=_int_at_least(1), default=16)
    demo.add_argument("--head-dim", type=_int_at_least(1), default=64)
    demo.add_argument("--kpool", type=_int_at_least(1), default=4)
    demo.add_argument("--topk", type=_int_at_least(1), default=256, help="a multiple of --kpool")
    demo.add_argument("--seed", type=_int_at_least(0), default=0)
    demo.add_argument("--timeout", type=_float_in(0, open_low=True), default=300.0, help="seconds")
    demo.add_argument("--progress-every", type=_float_in(0, open_low=True), default=10.0,
                      help="seconds between progress lines while the ranks run")  # fmt: skip
    demo.add_argument("--layout", choices=["contiguous", "zigzag", "zigzag-per-document", "positions"],
                      default="contiguous", help="which rows each rank owns (positions: a random permutation)")
    par = sub.add_parser(
        "parity",
        help="replay a captured indexer call in two arms (precision[:backend]) and compare them",
        description="Recompute a capture (sp_kpool.capture) in arms A and B on identical inputs and print "
        "a table, and write parity.json, parity.txt and two PNG plots (to --out; the plots need matplotlib, "
        "without it they are skipped and said so). An arm is "
        "precision[:backend][+decode], precision in bf16, bf16-serving, fp8; backend defaults to auto; "
        "+decode compresses every pool in the decode order, ignoring the captured prompt lengths "
        "(fp8 vs fp8+decode: what the compression schedule changes).",
        **fmt,
    )
    par.add_argument("capture", nargs="?", metavar="CAPTURE", help="a capture file (other ranks' files are read from its directory)")
    par.add_argument("--a", type=_arm, default="fp8", help="arm A")
    par.add_argument("--b", type=_arm, default="bf16-serving", help="arm B, the reference of relative errors")
    par.add_argument("--out", help="directory for parity.json, parity.txt, the PNGs (and the synthetic capture); "
                     "default: a new folder sp_kpool-parity-DATE-TIME in the current directory")  # fmt: skip
    par.add_argument("--device", type=device_flag(auto=True), default="auto",
                     help="auto (cuda if available), cpu, cuda, cuda:N")
    par.add_argument("--no-repeat", action="store_true", help="skip the second run of each arm (determinism check)")
    par.add_argument("--no-plots", action="store_true")
    par.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    syn = par.add_argument_group("synthetic capture (--synthetic: random weights and inputs, real shapes)")
    syn.add_argument("--synthetic", action="store_true")
    syn.add_argument("--capture-dir", help="where the synthetic capture goes (default OUT/capture, else a temporary directory)")
    syn.add_argument("--tokens", type=_int_at_least(1), default=4096)
    syn.add_argument("--docs", type=_int_at_least(1), default=1)
    syn.add_argument("--world-size", type=_int_at_least(1), default=1)
    syn.add_argument("--rank", type=_int_at_least(0), default=0, help="which rank's file to replay")
    syn.add_argument("--hidden-size", type=_int_at_least(1), default=4096)
    syn.add_argument("--q-lora-rank", type=_int_at_least(1), default=1536)
    syn.add_argument("--heads", type=_int_at_least(1), default=32)
    syn.add_argument("--head-dim", type=_int_at_least(1), default=128)
    syn.add_argument("--topk", type=_int_at_least(1), default=2048)
    syn.add_argument("--kpool", type=_int_at_least(1), default=4)
    syn.add_argument("--capture-precision", choices=PRECISIONS, default="bf16", help="precision of the simulated live call")
    syn.add_argument("--capture-backend", choices=backend_names(), default="auto", help="backend of the simulated live call")
    syn.add_argument("--seed", type=_int_at_least(0), default=0)
    syn.add_argument("--prompt-fraction", type=_float_in(0, 1), default=None,
                     help="record prompt lengths of this fraction of every document (the serving compression "
                          "schedule: prompt pools in extend order); default: none (all decode)")  # fmt: skip
    for parser in (info, demo, par):  # every flag with a value shows its default in --help
        for action in parser._actions:
            if action.help is None and action.default is not None and action.default is not False:
                action.help = _FLAG_HELP.get(action.dest, action.dest.replace("_", " "))
    args = ap.parse_args(argv)
    if args.cmd == "demo":
        _check_operator_flags(demo, args)
    elif args.cmd == "parity" and args.synthetic:
        _check_operator_flags(par, args)
    return {"info": _cmd_info, "demo": _cmd_demo, "parity": _cmd_parity}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
