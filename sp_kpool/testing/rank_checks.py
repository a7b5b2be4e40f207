"""Per-rank bodies for multi-rank checks (pytest via ``run_ranks``, torchrun, mpirun, CLI).

Every rank builds the same global inputs from one seed, runs its shard through the real
collectives, recomputes world size 1 locally, and compares its rows bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..api import kpool_topk
from ..sharding import ShardedSequence
from .invariants import check_invariants
from .problems import make_inputs, shard_inputs

__all__ = ["RankReport", "sharded_vs_world1", "bad_input_on_one_rank", "STANDARD_CASES"]

#: (document lengths, kpool, topk): odd global lengths, pools straddling seams, shards
#: starting mid-document, and (with enough ranks) a shard holding only padding.
STANDARD_CASES = [
    ([37, 1, 3, 64, 2, 46], 4, 16),
    ([301], 4, 32),
    ([5], 4, 8),
    ([13, 17, 19], 2, 8),
    ([50, 31], 16, 32),
]


@dataclass
class RankReport:
    rank: int
    world_size: int
    shard: tuple[int, int]
    real_rows: int
    selected: int
    equal: bool
    backend: str


def sharded_vs_world1(
    rank: int, world_size: int, lengths, kpool: int, topk: int, *, heads=8, head_dim=16, seed=0,
    device="cpu", backend="torch", group=None, dtype=torch.float32, **options,
) -> RankReport:  # fmt: skip
    """Run this rank's shard with the real collectives and compare to world size 1
    (computed on this rank with the same options, plain split, gather-keys)."""
    x = make_inputs(lengths, heads=heads, head_dim=head_dim, kpool=kpool, seed=seed, dtype=dtype)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=world_size, rank=rank, group=group)
    opts = dict(topk=topk, kpool=kpool, backend=backend, **options)
    out = kpool_topk(**shard_inputs(x, seq, device), seq=seq, **opts)
    check_invariants(out, seq, topk=topk, kpool=kpool, tail=opts.get("tail", "fixed"), alignment=opts.get("alignment", 1))
    seq1 = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    ref_opts = {k: v for k, v in opts.items() if k not in ("gather", "balance", "balance_block")}
    ref = kpool_topk(**shard_inputs(x, seq1, device), seq=seq1, **ref_opts)
    lo, hi = seq.shard_start, min(seq.shard_end, seq.num_real_tokens)
    n = max(0, hi - lo)
    equal = torch.equal(out[:n], ref[lo:hi]) and bool((out[n:] == -1).all())
    return RankReport(
        rank=rank, world_size=world_size, shard=(seq.shard_start, seq.shard_end), real_rows=n,
        selected=int((out >= 0).sum()), equal=equal, backend=backend,
    )  # fmt: skip


def bad_input_on_one_rank(rank: int, world_size: int, case: str) -> str:
    """Give one rank (the last) bad input; return the message this rank raised. Case
    ``"budget"``: every rank passes a logits budget too small for one row, on 5 tokens (with
    4 ranks, the last shard holds only padding)."""
    x = make_inputs([5] if case == "budget" else [23], heads=8, head_dim=16, kpool=4, seed=1)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=world_size, rank=rank)
    args = shard_inputs(x, seq)
    topk = 8
    last = rank == world_size - 1
    if case == "budget":
        args["max_logits_bytes"] = 2
    if case == "shape" and last:
        args["k"] = args["k"][:, :-1]
    if case == "topk" and last:
        topk = 12
    if case == "dtype" and last:
        args["gates"] = args["gates"].to(torch.int32)
    if case == "float dtype" and last:  # valid on its own, but not what the other ranks send
        args["k"] = args["k"].to(torch.bfloat16)
    try:
        kpool_topk(**args, seq=seq, topk=topk)
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"
