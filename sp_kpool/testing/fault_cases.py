"""Per-rank bodies of the fault suite (``tests/unit/test_faults.py``, via ``run_ranks``).

One rank (the last) is given one fault at a time; every rank reports what it raised as
``(exception type name, message)`` (or ``("no error", "")``). Faults that the agreement
decides (:data:`AGREED_FAULTS`) leave the process group usable, so one spawn runs them all
in turn; faults that break the group (a rank that dies, or never calls) each get a spawn
of their own (:func:`rank_dies`, :func:`rank_never_calls`, :func:`local_call_on_one_rank`).
"""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np
import torch

from ..api import kpool_topk
from ..settings import Settings, current_settings
from ..sharding import ShardedSequence
from .problems import make_inputs, shard_inputs

__all__ = ["AGREED_FAULTS", "agreed_faults", "rank_dies", "rank_never_calls", "local_call_on_one_rank",
           "indexer_faults"]  # fmt: skip

#: seconds the agreement waits in the faults that leave a rank out (short: the suite waits it)
COMM_TIMEOUT = 5.0
LENGTHS = [23, 6]


def _outcome(fn: Callable) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the suite compares every rank's outcome
        return type(exc).__name__, str(exc)
    return "no error", ""


class _Env:
    """Set process environment variables for one call (the process settings re-read)."""

    def __init__(self, values: dict[str, str]):
        self.values, self.saved = values, {}

    def __enter__(self):
        for k, v in self.values.items():
            self.saved[k] = os.environ.get(k)
            os.environ[k] = v
        current_settings.cache_clear()

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        current_settings.cache_clear()


def _with(name, value):
    def mutate(call):
        call["args"][name] = value(call["args"][name]) if callable(value) else value

    return mutate


def _kw(**kw):
    def mutate(call):
        call["kw"].update(kw)

    return mutate


def _env(**values):
    def mutate(call):
        call["env"].update(values)
        call["settings"] = None  # the process settings, read from the environment

    return mutate


def _seq(build):
    def mutate(call):
        call["seq"] = build(call)

    return mutate


def _other_rows(total: int, world_size: int) -> list[list[int]]:
    """Contiguous rows as ``split`` gives them to ``world_size`` ranks, but one row of rank 0
    moved to rank 1 (the last rank keeps its local row count when ``total`` leaves it one
    row short of the others)."""
    size = -(-total // world_size)
    rows = [list(range(r * size, min(total, (r + 1) * size))) for r in range(world_size)]
    rows[1].insert(0, rows[0].pop())
    return rows


def _nan(name, row=2):
    def mutate(call):
        t = call["args"][name]
        t.view(t.shape[0], -1)[row, 1] = float("nan")

    return mutate


def _bf16(name):
    return _with(name, lambda t: t.to(torch.bfloat16))


#: fault -> (what the last rank does differently, text every rank's message holds)
AGREED_FAULTS: dict[str, tuple[Callable, str]] = {
    # the environment of one rank (the README's promise: every rank raises alike)
    "env precision": (_env(SP_KPOOL_PRECISION="bf17"), "SP_KPOOL_PRECISION: expected one of"),
    "env max_logits_bytes": (_env(SP_KPOOL_MAX_LOGITS_BYTES="lots"), "SP_KPOOL_MAX_LOGITS_BYTES: expected a positive"),
    "env check_finite": (_env(SP_KPOOL_CHECK_FINITE="yes"), "SP_KPOOL_CHECK_FINITE: expected 0 or 1, got 'yes'"),
    "env check_finite on": (_env(SP_KPOOL_CHECK_FINITE="1"), "check_finite (resolved): per rank"),
    "env budget differs": (_env(SP_KPOOL_MAX_LOGITS_BYTES="65536"), "max_logits_bytes: per rank"),
    # the sequence
    "seq not a ShardedSequence": (_seq(lambda c: [0, 29]), "seq: expected a ShardedSequence, got list"),
    "seq rank 0": (_seq(lambda c: ShardedSequence.split(c["cu"], world_size=c["ws"], rank=0)),
                   "seq.rank: expected"),
    "seq world size + 1": (
        _seq(lambda c: ShardedSequence.split(c["cu"], world_size=c["ws"] + 1, rank=c["rank"])), "seq.world_size: expected"),
    "seq other documents": (_seq(lambda c: ShardedSequence.split([0, 20, 29], world_size=c["ws"], rank=c["rank"])),
                            "cu_seq_lens (crc32): per rank"),
    # the same local row count on the last rank (a valid call), other rows: rank 0 one fewer
    "seq other rows": (_seq(lambda c: ShardedSequence.from_rank_positions(
        c["cu"], _other_rows(int(c["cu"][-1]), c["ws"]), rank=c["rank"])), "rows per rank (crc32): per rank"),
    "seq prompt_lens": (_seq(lambda c: ShardedSequence.split(c["cu"], world_size=c["ws"], rank=c["rank"],
                                                             prompt_lens=[8, 0])), "prompt_lens (crc32): per rank"),
    # tensors: dtype, device type, shape, type
    **{f"{n} bfloat16": (_bf16(n), f"{n}.dtype: per rank") for n in ("gates", "head_weights", "ape")},
    # q and k share a dtype on each rank (a local check); both changed: the ranks disagree
    "q bfloat16": (_bf16("q"), "k: expected dtype torch.bfloat16 (the dtype of q"),
    "k bfloat16": (_bf16("k"), "k: expected dtype torch.float32 (the dtype of q"),
    "q and k bfloat16": (lambda c: (_bf16("q")(c), _bf16("k")(c)), "q.dtype: per rank"),
    "all tensors on meta": (lambda c: c["args"].update({k: v.to("meta") for k, v in c["args"].items()}),
                            "q.device type: per rank"),
    "k on meta": (_with("k", lambda t: t.to("meta")), "k: expected device cpu (the device of q), got meta"),
    "k shape": (_with("k", lambda t: t[:, :-1]), "k: expected shape"),
    "gates int32": (_with("gates", lambda t: t.to(torch.int32)), "gates: expected a floating-point dtype"),
    "q fewer heads": (lambda c: c["args"].update(q=c["args"]["q"][:, :4], head_weights=c["args"]["head_weights"][:, :4]),
                      "q.shape[1] (H): per rank"),
    "q numpy": (_with("q", lambda t: t.numpy()), "q: expected a torch.Tensor, got ndarray"),
    # options, each on one rank
    "topk": (_kw(topk=16), "topk: per rank [8, 16]"),
    "kpool": (lambda c: (_kw(kpool=2)(c), _with("ape", lambda t: t[:2])(c)), "kpool: per rank [4, 2]"),
    "tail": (_kw(tail="compact"), "tail: per rank ['fixed', 'compact']"),
    "order": (_kw(order="score"), "order: per rank ['ascending', 'score']"),
    "alignment": (_kw(alignment=16), "alignment: per rank [1, 16]"),
    "precision": (_kw(precision="fp8"), "precision: per rank ['bf16', 'fp8']"),
    "max_logits_bytes": (_kw(max_logits_bytes=1 << 16), "max_logits_bytes: per rank"),
    "gather": (_kw(gather="pools"), "gather: per rank ['keys', 'pools']"),
    "balance": (_kw(balance="causal"), "balance: per rank ['none', 'causal']"),
    "balance_block": (_kw(balance_block=8), "balance_block: per rank [-1, 8]"),
    "balance_row_cost": (_kw(balance_row_cost=3), "balance_row_cost: per rank [-1, 3]"),
    "check_finite": (_kw(check_finite=True), "check_finite (resolved): per rank [False, True]"),
    "backend bad": (_kw(backend="nope"), "backend: expected one of"),
    "tail bad": (_kw(tail="nope"), "tail: expected one of ['fixed', 'compact'], got 'nope'"),
    "topk 2**33": (_kw(topk=2**33), "topk: expected <="),
    "topk bool": (_kw(topk=True), "topk: expected int, got True"),
    "stats list": (_kw(stats=[]), "stats: expected a dict or None, got list"),
    "unknown keyword": (_kw(top_k=8), "unexpected keyword argument(s) ['top_k']"),
    "logits budget too small": (_kw(max_logits_bytes=2), "max_logits_bytes: expected at least"),
    # non-finite values, check_finite on every rank
    **{f"nan in {n}": (_nan(n), f"{n}: expected finite values (check_finite), got nan in ")
       for n in ("q", "k", "gates", "head_weights", "ape")},
    # integer-like values: accepted, no error (and the same result)
    "numpy topk": (_kw(topk=np.int64(8)), ""),
    "0-d tensor kpool": (_kw(kpool=torch.tensor(4)), ""),
    "numpy cu_seq_lens": (_seq(lambda c: ShardedSequence.split(np.array(c["cu"]), world_size=np.int64(c["ws"]),
                                                               rank=np.int32(c["rank"]))), ""),
}  # fmt: skip

_CHECK_FINITE_EVERYWHERE = {f"nan in {n}" for n in ("q", "k", "gates", "head_weights", "ape")}


def agreed_faults(rank: int, world_size: int, names: list[str]) -> dict[str, tuple[str, str]]:
    """For each fault of :data:`AGREED_FAULTS` named, the outcome on this rank (the last
    rank has the fault). Also ``"<name> ids"``: the output when there was no error."""
    x = make_inputs(LENGTHS, heads=8, head_dim=16, kpool=4, seed=3)
    cu = x.cu_seq_lens
    settings = Settings(comm_timeout=60.0)
    out = {}
    for name in names:
        seq = ShardedSequence.split(cu, world_size=world_size, rank=rank)
        args = {k: v.clone() for k, v in shard_inputs(x, seq).items()}  # faults write into them (ape is x.ape)
        call = {"args": args, "kw": {"topk": 8, "kpool": 4}, "env": {}, "seq": seq,
                "settings": settings, "cu": cu, "ws": world_size, "rank": rank}  # fmt: skip
        if name in _CHECK_FINITE_EVERYWHERE:
            call["kw"]["check_finite"] = True
        if rank == world_size - 1:
            AGREED_FAULTS[name][0](call)
        result = {}

        def run():
            with _Env(call["env"]):
                result["ids"] = kpool_topk(**call["args"], seq=call["seq"], settings=call["settings"], **call["kw"])

        out[name] = _outcome(run)
        if "ids" in result:
            out[name + " ids"] = result["ids"]
    return out


def _indexer(settings=None):
    from ..indexer import KPoolIndexer

    torch.manual_seed(0)
    m = KPoolIndexer(hidden_size=16, q_lora_rank=8, index_n_heads=4, index_head_dim=8, index_topk=8,
                     settings=settings or Settings(comm_timeout=60.0))  # fmt: skip
    for p in m.parameters():
        p.data.normal_()
    return m


def indexer_faults(rank: int, world_size: int) -> dict[str, tuple[str, str]]:
    """``KPoolIndexer.forward`` with a bad ``hidden`` on the last rank (a dtype, a shape),
    or that rank's precision default unreadable: the outcome on this rank, per fault."""
    m = _indexer()
    seq = ShardedSequence.split([0, 29], world_size=world_size, rank=rank)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(seq.shard_size, 16, generator=g)
    q_resid = torch.randn(seq.shard_size, 8, generator=g)
    last = rank == world_size - 1
    out = {
        "hidden float64": _outcome(lambda: m(hidden.double() if last else hidden, q_resid, seq)),
        "hidden shape": _outcome(lambda: m(hidden[:, :-1] if last else hidden, q_resid, seq)),
        "good": _outcome(lambda: m(hidden, q_resid, seq)),
    }

    def bad_env():
        with _Env({"SP_KPOOL_PRECISION": "bf17"} if last else {}):
            _indexer(current_settings())(hidden, q_resid, seq)

    out["env precision"] = _outcome(bad_env)
    return out


def rank_dies(rank: int, world_size: int, when: str) -> tuple[str, str]:
    """The last rank exits (``os._exit(3)``) ``"before"`` the call or in its first data
    collective (``"mid"``, after the agreement); the others report what they raised."""
    from .. import pipeline

    x = make_inputs(LENGTHS, heads=8, head_dim=16, kpool=4, seed=3)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=world_size, rank=rank)
    args = shard_inputs(x, seq)
    if rank == world_size - 1:
        if when == "before":
            os._exit(3)
        pipeline.gather_keys = lambda *a, **k: os._exit(3)  # this process only
    return _outcome(lambda: kpool_topk(**args, seq=seq, topk=8, settings=Settings(comm_timeout=COMM_TIMEOUT)))


def rank_never_calls(rank: int, world_size: int) -> tuple[str, str]:
    """The last rank never calls (it sleeps far past the timeout); the others raise, and
    re-raise, so that ``run_ranks`` reports them and ends the sleeper."""
    x = make_inputs(LENGTHS, heads=8, head_dim=16, kpool=4, seed=3)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=world_size, rank=rank)
    if rank == world_size - 1:
        time.sleep(600)
    kpool_topk(**shard_inputs(x, seq), seq=seq, topk=8, settings=Settings(comm_timeout=COMM_TIMEOUT))
    return "no error", ""


def local_call_on_one_rank(rank: int, world_size: int) -> tuple[str, str]:
    """The last rank builds a world-size-1 ``ShardedSequence`` (a local call, by contract:
    it never communicates) and passes its shard: it raises its own error at once; the
    others, alone in their agreement, raise within the timeout (or as soon as that rank's
    process ends)."""
    x = make_inputs(LENGTHS, heads=8, head_dim=16, kpool=4, seed=3)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=world_size, rank=rank)
    args = shard_inputs(x, seq)
    if rank == world_size - 1:
        seq = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    return _outcome(lambda: kpool_topk(**args, seq=seq, topk=8, settings=Settings(comm_timeout=COMM_TIMEOUT)))
