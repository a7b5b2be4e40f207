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
from .problems import make_inputs, random_rank_positions, shard_inputs, to_document_positions

__all__ = ["RankReport", "layout_seq", "sharded_vs_world1", "bad_input_on_one_rank", "STANDARD_CASES"]

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
    shard: tuple[int, int] | None
    real_rows: int
    selected: int
    equal: bool
    backend: str
    layout: str = "contiguous"


def layout_seq(cu_seq_lens, rank: int, world_size: int, layout: str = "contiguous", *, group=None,
               pad_multiple: int | None = None, seed: int = 0) -> ShardedSequence:  # fmt: skip
    """This rank's sequence of ``layout``: a layout name of :meth:`ShardedSequence.split`, or
    ``"positions"``: a random permutation of the tokens cut into random, uneven parts
    (from ``seed``, the same on every rank), through :meth:`ShardedSequence.from_positions`
    (which all-gathers the positions when ``world_size > 1``)."""
    if layout != "positions":
        return ShardedSequence.split(cu_seq_lens, world_size, rank, group, layout=layout, pad_multiple=pad_multiple)
    positions = random_rank_positions(int(cu_seq_lens[-1]), world_size, seed)[rank]
    return ShardedSequence.from_positions(cu_seq_lens, positions, world_size=world_size, rank=rank, group=group)


def sharded_vs_world1(
    rank: int, world_size: int, lengths, kpool: int, topk: int, *, heads=8, head_dim=16, seed=0,
    device="cpu", backend="torch", group=None, dtype=torch.float32, layout="contiguous", pad_multiple=None,
    **options,
) -> RankReport:  # fmt: skip
    """Run this rank's rows of ``layout`` (:func:`layout_seq`) with the real collectives and
    compare them to world size 1 (computed on this rank with the same options, contiguous,
    gather-keys): every real row's ids, mapped from stream positions to real rows, equal
    the world-size-1 row bit for bit, and padding rows are all ``-1``."""
    x = make_inputs(lengths, heads=heads, head_dim=head_dim, kpool=kpool, seed=seed, dtype=dtype)
    seq = layout_seq(x.cu_seq_lens, rank, world_size, layout, group=group, pad_multiple=pad_multiple, seed=seed)
    opts = dict(topk=topk, kpool=kpool, backend=backend, **options)
    out = kpool_topk(**shard_inputs(x, seq, device), seq=seq, **opts)
    check_invariants(out, seq, topk=topk, kpool=kpool, tail=opts.get("tail", "fixed"), alignment=opts.get("alignment", 1))
    seq1 = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    ref_opts = {k: v for k, v in opts.items() if k not in ("gather", "balance", "balance_block")}
    ref = kpool_topk(**shard_inputs(x, seq1, device), seq=seq1, **ref_opts)
    real = seq.real_of_stream[seq.positions]
    keep = real >= 0
    got = to_document_positions(out.cpu(), seq)
    equal = torch.equal(got[keep], ref.cpu()[real[keep]]) and bool((out.cpu()[~keep] == -1).all())
    return RankReport(
        rank=rank, world_size=world_size, shard=(seq.shard_start, seq.shard_end) if seq.is_contiguous else None,
        real_rows=int(keep.sum()), selected=int((out >= 0).sum()), equal=equal, backend=backend, layout=layout,
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
        args["q"] = args["q"].to(torch.bfloat16)
        args["k"] = args["k"].to(torch.bfloat16)
    try:
        kpool_topk(**args, seq=seq, topk=topk)
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"
