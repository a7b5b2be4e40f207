"""The cost of ``check_finite=True`` on a CUDA host: the check alone, and a whole
world-size-1 call with and without it (one 32768-token document, H 32, D 128, topk 2048,
fp8 on the deepgemm backend; median of synchronized calls, off / on / off / on).

    python -m sp_kpool.bench check-finite [--out DIR]

Prints one JSON line; ``--out DIR`` also writes ``check_finite.json`` with the environment
block. Needs CUDA and deep_gemm (the GPU wheels: ``scripts/gpu_wheels.sh``).
"""

from __future__ import annotations


import torch

from .record import command_line, environment, log, parser, require_cuda, save
from .timing import median_seconds


def main(argv=None) -> int:
    ap = parser("check-finite", __doc__)
    ap.add_argument("--out", default=None, help="also write check_finite.json here")
    args = ap.parse_args(argv)
    require_cuda("check-finite")
    from .. import ShardedSequence, kpool_topk
    from ..agreement import _check_finite

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    S, H, D = 32768, 32, 128
    bf = torch.bfloat16

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=dev)

    t = {"q": rnd(S, H, D).to(bf), "k": rnd(S, D).to(bf), "gates": rnd(S, D).to(bf), "head_weights": rnd(S, H).float(),
         "ape": (rnd(4, D) * 0.5).to(bf)}  # fmt: skip
    seq = ShardedSequence.split([0, S], 1, 0)

    def ms(fn, reps=20):
        return round(1e3 * median_seconds(fn, dev, reps=reps, warmup=3), 3)

    res = {"check_alone_ms": ms(lambda: _check_finite(t, seq))}
    for flag in (False, True, False, True):
        res.setdefault(f"whole_call_check_finite_{flag}_ms", []).append(
            ms(lambda: kpool_topk(**t, seq=seq, topk=2048, kpool=4, precision="fp8", backend="deepgemm",  # noqa: B023
                                  check_finite=flag), reps=10))  # fmt: skip
    log(res)
    if args.out:
        save({"environment": environment(command_line("check-finite", argv), dev, packages=("deep_gemm",)),
              "args": vars(args), **res}, args.out, "check_finite.json")  # fmt: skip
    return 0
