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
from .registry import backend_names
from .settings import PRECISIONS, Settings

__all__ = [
    "KPoolConfig", "RunOptions", "TAILS", "ORDERS", "GATHERS", "BALANCES", "ROW_COST", "MAX_WIDTH", "split_keywords",
    "output_width",
]  # fmt: skip

#: ``tail=``: history in ``[0, topk)`` and the tail after it (``fixed``), or the tail right
#: after the valid history (``compact``, as serving lays it out).
TAILS = ("fixed", "compact")
#: ``order=``: selected pools by ascending id, by descending score (ties toward the lower
#: id), or in the order of the serving selector (not deterministic); ``ascending-unused-first``:
#: ascending id with the unused (``-1``) history slots first, so the last pool ends at column
#: ``topk`` (XTuner's canonical order, ``tail="fixed"`` only).
ORDERS = ("ascending", "score", "serving", "ascending-unused-first")
#: ``order="ascending-unused-first"``: selected ascending; the expansion puts the unused slots first.
UNUSED_FIRST = "ascending-unused-first"
#: ``gather=``: all-gather keys and gates, then pool (``keys``), or pool per shard with a
#: seam exchange, then all-gather the pooled keys (``pools``).
GATHERS = ("keys", "pools")
#: ``balance=``: keep the contiguous split (``none``) or balance the causal work (``causal``).
BALANCES = ("none", "causal")
#: Default per-row constant of the balance work model (:mod:`sp_kpool.balance`), in units of
#: one (row, pool) score: a row's own handling (query preparation, its Top-K output) that
#: does not grow with its history. A backend's ``balance_row_cost`` defaults to it; here,
#: at the bottom, so that the backend interface does not import the balance.
ROW_COST = 1


def output_width(topk: int, kpool: int, alignment: int) -> int:
    """``align(topk + kpool - 1, alignment)``: 2051 for the checkpoint with alignment 1."""
    w = topk + kpool - 1
    return -(-w // alignment) * alignment


#: The widest output row: ids and columns are int32.
MAX_WIDTH = 2**31 - 1


def _index(value, choices) -> int:
    return choices.index(value) if value in choices else -1


def _choice_entry(name: str, value, choices) -> tuple[str, int, dict]:
    """A signature entry whose disagreement message shows the values, not their codes."""
    return (name, _index(value, choices), {-1: "unset", **dict(enumerate(choices))})


def _optional(value) -> int:
    return value if value is not None else -1


def _set_int(record, name: str, minimum: int, maximum: int | None = None) -> None:
    """Validate the integer-like field ``name`` of a frozen record and store it as an ``int``."""
    object.__setattr__(record, name, check_int(name, getattr(record, name), minimum, maximum))


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
        _set_int(self, "kpool", 1)
        # output columns and ids are int32: align(topk + kpool - 1) must stay below 2**31
        _set_int(self, "topk", 1, MAX_WIDTH - self.kpool + 1)
        if self.topk % self.kpool:
            raise ValueError(
                f"topk: expected a multiple of kpool = {self.kpool}, got {self.topk} "
                f"(topk % kpool = {self.topk % self.kpool})"
            )
        _set_int(self, "alignment", 1)
        if self.width > MAX_WIDTH:
            raise ValueError(f"alignment: the output width align(topk + kpool - 1, {self.alignment}) = {self.width} "
                             f"exceeds {MAX_WIDTH} (int32 columns)")  # fmt: skip
        if self.max_logits_bytes is not None:
            _set_int(self, "max_logits_bytes", 1)
        check_choice("tail", self.tail, TAILS)
        check_choice("order", self.order, ORDERS)
        if self.order == UNUSED_FIRST and self.tail != "fixed":
            raise ValueError(f"order: 'ascending-unused-first' puts the unused history slots first, so the history "
                             f"always ends at column topk; it needs tail='fixed', got tail={self.tail!r}")  # fmt: skip
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
            _choice_entry("tail", self.tail, TAILS),
            _choice_entry("order", self.order, ORDERS),
            ("alignment", self.alignment),
            ("max_logits_bytes", _optional(self.max_logits_bytes)),
            _choice_entry("precision", self.precision, PRECISIONS),
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

    backend: a registered backend name (:mod:`sp_kpool.registry`) or ``"auto"`` (see
        ``python -m sp_kpool info``).
    gather: one of :data:`GATHERS` (see :mod:`sp_kpool.pool_gather`).
    balance: one of :data:`BALANCES` (see :mod:`sp_kpool.balance`).
    balance_block: boundaries of the balanced split are multiples of this many rows
        (``None``: the scoring chunk of the backend).
    balance_row_cost: the per-row constant of the balance work model (``None``: the
        backend's ``balance_row_cost``).
    check_finite: raise (on every rank) if an input tensor holds a NaN or an infinity,
        naming the tensor and its first such row, at the cost of one device-to-host read
        (``None``: the settings' ``check_finite``, ``$SP_KPOOL_CHECK_FINITE``, default off).
    """

    backend: str = "torch"
    gather: str = "keys"
    balance: str = "none"
    balance_block: int | None = None
    balance_row_cost: int | None = None
    check_finite: bool | None = None

    def __post_init__(self):
        if not isinstance(self.backend, str):
            raise TypeError(f"backend: expected a backend name (str), got {self.backend!r}")
        check_choice("backend", self.backend, backend_names())
        check_choice("gather", self.gather, GATHERS)
        check_choice("balance", self.balance, BALANCES)
        if self.balance_block is not None:
            _set_int(self, "balance_block", 1)
        if self.balance_row_cost is not None:
            _set_int(self, "balance_row_cost", 0)
        if self.check_finite is not None and not isinstance(self.check_finite, bool):
            raise TypeError(f"check_finite: expected a bool or None, got {self.check_finite!r}")

    def replace(self, **changes) -> "RunOptions":
        return dataclasses.replace(self, **changes)

    def signature(self) -> list[tuple[str, int]]:
        """Integers that must agree on every rank (the backend is compared once resolved)."""
        return [
            _choice_entry("gather", self.gather, GATHERS),
            _choice_entry("balance", self.balance, BALANCES),
            ("balance_block", _optional(self.balance_block)),
            ("balance_row_cost", _optional(self.balance_row_cost)),
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
