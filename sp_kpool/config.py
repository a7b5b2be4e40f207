"""The settings of one operator call, as two frozen, self-validating records.

* :class:`KPoolConfig`: what is computed (budget ``topk``, pool size ``kpool``, tail and
  order of the columns, output alignment, arithmetic, logits budget). Two calls with
  equal configs on equal inputs return equal bits.
* :class:`RunOptions`: how it is computed (backend, gather, balance and its knobs). None
  of them changes an output bit.

Each has ``signature()`` (the integers every rank must agree on, checked by one small
all-gather) and ``record()`` / ``from_record()`` (the JSON-able form a capture stores, so
that a replay rebuilds exactly what ran). ``kpool_topk(..., config=cfg, options=opts)``
takes them; its keyword form (``topk=..., tail=..., gather=...``) builds them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from .checks import check_choice, check_int
from .settings import PRECISIONS, Settings

__all__ = ["KPoolConfig", "RunOptions", "TAILS", "ORDERS", "GATHERS", "BALANCES", "split_keywords", "output_width"]

#: ``tail=``: history in ``[0, topk)`` and the tail after it (``fixed``), or the tail right
#: after the valid history (``compact``, as serving lays it out).
TAILS = ("fixed", "compact")
#: ``order=``: selected pools by ascending id, by descending score (ties toward the lower
#: id), or in the order of the serving selector (not deterministic).
ORDERS = ("ascending", "score", "serving")
#: ``gather=``: all-gather keys and gates, then pool (``keys``), or pool per shard with a
#: seam exchange, then all-gather the pooled keys (``pools``).
GATHERS = ("keys", "pools")
#: ``balance=``: keep the contiguous split (``none``) or balance the causal work (``causal``).
BALANCES = ("none", "causal")


def output_width(topk: int, kpool: int, alignment: int) -> int:
    """``align(topk + kpool - 1, alignment)``: 2051 for the checkpoint with alignment 1."""
    w = topk + kpool - 1
    return -(-w // alignment) * alignment


def _index(value, choices) -> int:
    return choices.index(value) if value in choices else -1


@dataclass(frozen=True)
class KPoolConfig:
    """What one call computes (validated on construction).

    topk: token budget ``T``, a multiple of ``kpool``: ``topk // kpool`` pools per row.
    kpool: pool size ``K`` >= 1.
    tail: one of :data:`TAILS`. order: one of :data:`ORDERS`.
    alignment: the output width ``topk + kpool - 1`` is rounded up to a multiple of this.
    precision: one of ``bf16``, ``bf16-serving``, ``fp8``; ``None``: the process default
        (:class:`~sp_kpool.settings.Settings`), filled in by :meth:`resolve`.
    max_logits_bytes: scratch budget of one scoring chunk; ``None``: the process default
        for the device, filled in by :meth:`resolve`. Rows are bitwise equal across world
        sizes for equal budgets.
    """

    topk: int
    kpool: int = 4
    tail: str = "fixed"
    order: str = "ascending"
    alignment: int = 1
    precision: str | None = None
    max_logits_bytes: int | None = None

    def __post_init__(self):
        check_int("kpool", self.kpool, 1)
        check_int("topk", self.topk, 1)
        if self.topk % self.kpool:
            raise ValueError(
                f"topk: expected a multiple of kpool = {self.kpool}, got {self.topk} "
                f"(topk % kpool = {self.topk % self.kpool})"
            )
        check_int("alignment", self.alignment, 1)
        if self.max_logits_bytes is not None:
            check_int("max_logits_bytes", self.max_logits_bytes, 1)
        check_choice("tail", self.tail, TAILS)
        check_choice("order", self.order, ORDERS)
        if self.precision is not None:
            check_choice("precision", self.precision, PRECISIONS)

    @property
    def pools_per_row(self) -> int:
        """``topk // kpool``: pools selected per row."""
        return self.topk // self.kpool

    @property
    def width(self) -> int:
        """Output columns: ``align(topk + kpool - 1, alignment)``."""
        return output_width(self.topk, self.kpool, self.alignment)

    def replace(self, **changes) -> "KPoolConfig":
        return dataclasses.replace(self, **changes)

    def resolve(self, settings: Settings, device) -> "KPoolConfig":
        """This config with ``precision`` and ``max_logits_bytes`` filled in from
        ``settings`` (for tensors on ``device``)."""
        return self.replace(
            precision=self.precision or settings.precision,
            max_logits_bytes=self.max_logits_bytes or settings.logits_budget(device),
        )

    def signature(self) -> list[tuple[str, int]]:
        """Integers that must agree on every rank (of a resolved config)."""
        return [
            ("topk", self.topk),
            ("kpool", self.kpool),
            ("tail", _index(self.tail, TAILS)),
            ("order", _index(self.order, ORDERS)),
            ("alignment", self.alignment),
            ("max_logits_bytes", self.max_logits_bytes if self.max_logits_bytes is not None else -1),
            ("precision", _index(self.precision, PRECISIONS)),
        ]

    def record(self) -> dict[str, Any]:
        """JSON-able fields, as a capture stores them."""
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "KPoolConfig":
        return cls(**{f.name: record[f.name] for f in fields(cls) if f.name in record})


@dataclass(frozen=True)
class RunOptions:
    """How one call is computed (validated on construction); no option changes an output bit.

    backend: a registered backend name or ``"auto"`` (see ``python -m sp_kpool info``).
    gather: one of :data:`GATHERS` (see :mod:`sp_kpool.pool_gather`).
    balance: one of :data:`BALANCES` (see :mod:`sp_kpool.balance`).
    balance_block: boundaries of the balanced split are multiples of this many rows
        (``None``: the scoring chunk of the backend).
    balance_row_cost: the per-row constant of the balance work model (``None``: the
        backend's ``balance_row_cost``).
    """

    backend: str = "torch"
    gather: str = "keys"
    balance: str = "none"
    balance_block: int | None = None
    balance_row_cost: int | None = None

    def __post_init__(self):
        if not isinstance(self.backend, str):
            raise TypeError(f"backend: expected a backend name (str), got {self.backend!r}")
        check_choice("gather", self.gather, GATHERS)
        check_choice("balance", self.balance, BALANCES)
        if self.balance_block is not None:
            check_int("balance_block", self.balance_block, 1)
        if self.balance_row_cost is not None:
            check_int("balance_row_cost", self.balance_row_cost, 0)

    def replace(self, **changes) -> "RunOptions":
        return dataclasses.replace(self, **changes)

    def signature(self) -> list[tuple[str, int]]:
        """Integers that must agree on every rank (the backend is compared once resolved)."""
        return [
            ("gather", _index(self.gather, GATHERS)),
            ("balance", _index(self.balance, BALANCES)),
            ("balance_block", self.balance_block if self.balance_block is not None else -1),
            ("balance_row_cost", self.balance_row_cost if self.balance_row_cost is not None else -1),
        ]

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "RunOptions":
        return cls(**{f.name: record[f.name] for f in fields(cls) if f.name in record})


_CONFIG_FIELDS = tuple(f.name for f in fields(KPoolConfig))
_OPTION_FIELDS = tuple(f.name for f in fields(RunOptions))


def split_keywords(config: KPoolConfig | None, options: RunOptions | None, keywords: dict[str, Any]):
    """``(config, options)`` from the records given and the keyword form
    (``topk=..., tail=..., backend=..., gather=...``). A field given both in a record and
    as a keyword, or an unknown keyword, is a ``TypeError``."""
    unknown = sorted(set(keywords) - set(_CONFIG_FIELDS) - set(_OPTION_FIELDS))
    if unknown:
        raise TypeError(f"kpool_topk: unexpected keyword argument(s) {unknown}")
    cfg_kw = {k: v for k, v in keywords.items() if k in _CONFIG_FIELDS}
    opt_kw = {k: v for k, v in keywords.items() if k in _OPTION_FIELDS}
    if config is None:
        if "topk" not in cfg_kw:
            raise TypeError("topk: expected topk= (or config=KPoolConfig(...)), got neither")
        config = KPoolConfig(**cfg_kw)
    elif not isinstance(config, KPoolConfig):
        raise TypeError(f"config: expected a KPoolConfig, got {type(config).__name__}")
    elif cfg_kw:
        raise TypeError(f"config: {sorted(cfg_kw)} given both in config= and as keywords")
    if options is None:
        options = RunOptions(**opt_kw)
    elif not isinstance(options, RunOptions):
        raise TypeError(f"options: expected a RunOptions, got {type(options).__name__}")
    elif opt_kw:
        raise TypeError(f"options: {sorted(opt_kw)} given both in options= and as keywords")
    return config, options
