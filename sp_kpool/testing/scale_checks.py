"""Per-rank bodies for the scale options (``gather="pools"``, ``balance="causal"``).

Every rank builds the same global inputs from one seed, computes the world-size-1 result
of the plain path (``gather="keys"``, ``balance="none"``) locally, runs its shard through
the real collectives in every combination of the options, and compares its rows bit for
bit. It also returns what must agree across ranks (the balance decision and boundaries)
and the instrumented bytes, so that the test can check them against the layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..api import kpool_topk
from ..pooling import pool_table
from ..sharding import ShardedSequence
from .invariants import check_invariants
from .problems import make_inputs, shard_inputs

__all__ = [
    "ScaleCase",
    "ScaleReport",
    "SCALE_CASES",
    "COMBINATIONS",
    "scale_vs_world1",
    "BAD_SCALE_OPTIONS",
    "bad_scale_options_on_one_rank",
]


@dataclass(frozen=True)
class ScaleCase:
    """One layout. ``lengths``: documents; ``options``: extra ``kpool_topk`` keywords."""

    name: str
    lengths: tuple[int, ...]
    kpool: int
    topk: int
    dtype: torch.dtype = torch.float32
    precision: str = "bf16"
    options: dict = field(default_factory=dict)


#: Odd lengths, many documents, one long document, documents without a complete pool,
#: seams inside pools (also one needing rows from two ranks to the right), shards of only
#: padding, BF16 inputs moved as bytes, FP8 pools (values and scales) gathered, a small
#: logits budget (many chunks; default balance block = the chunk), explicit blocks that do
#: not divide the chunk (a chunk scored by two ranks), score order and compact tails.
SCALE_CASES = [
    ScaleCase("odd-many-docs", (37, 1, 3, 64, 2, 46), 4, 16, options=dict(balance_block=4)),
    ScaleCase("one-long-doc", (301,), 4, 32, options=dict(max_logits_bytes=20_000)),
    ScaleCase("one-long-doc-bf16", (203,), 4, 16, torch.bfloat16, options=dict(balance_block=3, order="score")),
    ScaleCase("no-complete-pool", (3, 2, 1, 3, 3, 2, 1), 4, 8, options=dict(balance_block=1)),
    ScaleCase("halo-two-ranks", (3, 26), 16, 32, options=dict(balance_block=2)),
    ScaleCase("tiny-padding-shard", (5,), 4, 8, options=dict(balance_block=1, tail="compact")),
    ScaleCase("many-docs", tuple([9, 17, 4, 30, 1, 12] * 6), 2, 8, options=dict(balance_block=5, balance_row_cost=3)),
    ScaleCase("fp8", (150, 41), 4, 16, torch.bfloat16, "fp8", options=dict(balance_block=8)),
    ScaleCase("bf16-serving", (97, 60), 4, 16, torch.bfloat16, "bf16-serving", options=dict(balance_block=8)),
]


#: (gather, balance, with stats): every option with and without the staged stats path.
COMBINATIONS = [("keys", "none", True), ("keys", "causal", False), ("pools", "none", False), ("pools", "causal", True)]


@dataclass
class ScaleReport:
    case: str
    gather: str
    balance: str
    with_stats: bool
    equal: bool
    applied: bool | None = None
    bounds: tuple | None = None
    work: tuple | None = None
    total: int | None = None
    max_block_work: int | None = None
    bytes: dict | None = None
    expected_bytes: dict | None = None


def _expected_bytes(case: ScaleCase, seq: ShardedSequence, gather: str, head_dim: int) -> dict:
    """What the gathers must move for this layout, from first principles."""
    R, ss, es = seq.world_size, seq.shard_size, torch.empty((), dtype=case.dtype).element_size()
    if R == 1:
        return {}
    if gather == "keys":
        one = (R - 1) * ss * head_dim * es  # each of k and gates
        return {"gather_keys": {"sent": 2 * one, "received": 2 * one, "calls": 2}}
    pts, _ = pool_table(seq.real_cu_seq_lens, case.kpool)
    starts = pts.tolist()
    counts = [sum(1 for s in starts if r * ss <= s < (r + 1) * ss) for r in range(R)]
    if case.precision == "fp8":
        per_pool = head_dim * 1 + 4  # E4M3 values + one FP32 scale
    else:  # bf16 pools in the key dtype, bf16-serving pools stored BF16
        per_pool = head_dim * (2 if case.precision == "bf16-serving" else es)
    out = {}
    if max(counts):
        moved = (R - 1) * max(counts) * per_pool
        out["gather_pools"] = {"sent": moved, "received": moved, "calls": 1}
    # seam rows: tokens past each shard that the shard's last pool needs, from anyone
    need = [0] * R
    for r in range(R):
        mine = [s for s in starts if r * ss <= s < (r + 1) * ss]
        if mine:
            need[r] = max(0, mine[-1] + case.kpool - (r + 1) * ss)
    recv = need[seq.rank] * 2 * head_dim * es
    sent = 0
    for r in range(R):
        lo, hi = (r + 1) * ss, (r + 1) * ss + need[r]
        a, b = max(lo, seq.rank * ss), min(hi, (seq.rank + 1) * ss)
        if r != seq.rank and b > a:
            sent += (b - a) * 2 * head_dim * es
    if sent or recv:
        out["seam"] = {"sent": sent, "received": recv, "calls": 1}
    return out


def scale_vs_world1(
    rank: int, world_size: int, cases=None, *, heads=8, head_dim=16, device="cpu", group=None, backend="torch"
) -> list[ScaleReport]:
    """Every case, every combination of ``gather`` and ``balance`` (:data:`COMBINATIONS`):
    this rank's rows against the world-size-1 plain path."""
    reports = []
    for i, case in enumerate(SCALE_CASES if cases is None else cases):
        x = make_inputs(list(case.lengths), heads=heads, head_dim=head_dim, kpool=case.kpool, seed=100 + i,
                        dtype=case.dtype)  # fmt: skip
        opts = dict(topk=case.topk, kpool=case.kpool, precision=case.precision, backend=backend, **case.options)
        plain = {k: v for k, v in opts.items() if not k.startswith("balance_")}
        seq1 = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
        ref = kpool_topk(**shard_inputs(x, seq1, device), seq=seq1, **plain)
        seq = ShardedSequence.split(x.cu_seq_lens, world_size=world_size, rank=rank, group=group)
        lo, hi = seq.shard_start, min(seq.shard_end, seq.num_real_tokens)
        n = max(0, hi - lo)
        # stats stage the plain path through the balance driver: half the combinations
        # run with stats (bytes of both gathers, the partition), half without.
        for gather, balance, with_stats in COMBINATIONS:
            stats = {} if with_stats else None
            out = kpool_topk(**shard_inputs(x, seq, device), seq=seq, gather=gather, balance=balance,
                             stats=stats, **opts)  # fmt: skip
            check_invariants(out, seq, topk=case.topk, kpool=case.kpool, tail=opts.get("tail", "fixed"))
            equal = torch.equal(out[:n], ref[lo:hi]) and bool((out[n:] == -1).all())
            rep = ScaleReport(case.name, gather, balance, with_stats, equal)
            if stats is not None:
                part = stats["partition"]
                if part is not None:
                    rep.applied = part["applied"]
                    rep.bounds = tuple(part["bounds"])
                    rep.work = tuple(part["work"])
                    rep.total = part["total"]
                    rep.max_block_work = part["max_block_work"]
                tags = stats["bytes"]["by_tag"]
                rep.bytes = {t: v for t, v in tags.items() if t in ("gather_keys", "gather_pools", "seam")}
                rep.expected_bytes = _expected_bytes(case, seq, gather, head_dim)
            reports.append(rep)
    return reports


#: Bad or disagreeing scale options, given to the last rank only.
BAD_SCALE_OPTIONS = {
    "gather": dict(gather="all"),
    "balance": dict(balance="greedy"),
    "block": dict(balance="causal", balance_block=0),
    "row_cost": dict(balance="causal", balance_row_cost=-1),
    "disagree": dict(gather="pools"),
    "stats": dict(stats=[]),
}


def bad_scale_options_on_one_rank(rank: int, world_size: int) -> dict[str, str]:
    """For each entry of :data:`BAD_SCALE_OPTIONS`, the message this rank raised."""
    x = make_inputs([23], heads=8, head_dim=16, kpool=4, seed=1)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=world_size, rank=rank)
    messages = {}
    for case, bad in BAD_SCALE_OPTIONS.items():
        kw = bad if rank == world_size - 1 else {}
        try:
            kpool_topk(**shard_inputs(x, seq), seq=seq, topk=8, **kw)
            messages[case] = "no error"
        except (TypeError, ValueError) as exc:
            messages[case] = str(exc)
    return messages
