"""The per-batch object: what the pipeline derives once per batch from a sequence.

FlashInfer splits an attention call in two: ``plan`` (host work on the batch's lengths,
once per batch) and ``run`` (every layer). Here the plan half is kept in a
:class:`BatchCache`: every :class:`~sp_kpool.sharding.ShardedSequence` makes one when it
is built (``seq.batch``, never replaced), and every layer called with that sequence
reuses what it holds, in named sections::

    section       key                                   value (built by)
    plans         boundaries, kpool, C, rows, device    ChunkPlan and its device tables
                  and stream                            (sp_kpool.plan.plan_chunks)
    spans         C                                     this rank's Spans (sp_kpool.plan.row_spans)
    row_work      kpool, row_cost                       W [N + 1] int64 (sp_kpool.balance.row_work)
    owned_work    kpool, row_cost                       per-rank work (sp_kpool.balance.owned_work)
    partitions    kpool, shard, block, row_cost, owned  CausalPartition
                                                        (sp_kpool.balance.sequence_partition)
    chunks        backend, pools, config, settings,     rows per scoring chunk
                  heads, head dim, device               (sp_kpool.agreement.scoring_chunk_rows)
    training_rows kpool                                 RowTables (sp_kpool.training.rows.row_tables)

(a key holds what a value depends on besides the sequence itself: its boundaries and
world size are fixed with it)

What goes in is built by the module that owns the concept, from global quantities (the
same on every rank); this object only keeps it, and nothing else is written into a
sequence. ``Settings.table_cache = False`` (``SP_KPOOL_TABLE_CACHE=0``) turns it off: the
callers pass ``cache=False`` and every value is built on every call, nothing kept. A
section keeps at most a few entries (least recently used first out); thread-safe; the
object lives and dies with its sequence.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable

__all__ = ["BatchCache", "TableCache", "SECTIONS"]

#: The sections of a :class:`BatchCache` and the entries each keeps.
SECTIONS = {"plans": 8, "spans": 8, "row_work": 4, "owned_work": 8, "partitions": 16, "chunks": 8, "training_rows": 4}


class TableCache:
    """A small LRU of one section of a :class:`BatchCache` (the chunk plans: ``seq.tables``).

    Keys are everything a value depends on besides its sequence (for the plans: the
    boundaries by value, ``kpool``, chunk rows, row range, device, CUDA stream); at most
    ``max_entries`` values are kept (a plan holds a few MB of device tables for a rank of
    4 x 32768 tokens). Thread-safe.
    """

    def __init__(self, max_entries: int = 8):
        self.max_entries = max_entries
        self._values: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any, build: Callable[[], Any]) -> Any:
        """The value of ``key``, built by ``build()`` (and kept) when absent."""
        with self._lock:
            hit = self._values.get(key)
            if hit is not None:
                self._values.move_to_end(key)
                return hit
        value = build()
        with self._lock:
            self._values[key] = value
            while len(self._values) > self.max_entries:
                self._values.popitem(last=False)
        return value

    def clear(self) -> None:
        """Forget every value."""
        with self._lock:
            self._values.clear()

    def __len__(self) -> int:
        return len(self._values)


class BatchCache:
    """What the pipeline derived from one sequence (one batch), by section (:data:`SECTIONS`).

    tables: the ``plans`` section (:class:`TableCache` of
    :class:`~sp_kpool.plan.ChunkPlan`, also ``seq.tables``). :meth:`get` looks a value up
    or builds it; ``len()`` counts the values of every section, :meth:`clear` forgets them.
    """

    def __init__(self):
        self._sections = {name: TableCache(n) for name, n in SECTIONS.items()}

    @property
    def tables(self) -> TableCache:
        """The chunk plans and their device tables (the ``plans`` section)."""
        return self._sections["plans"]

    def section(self, name: str) -> TableCache:
        """The :class:`TableCache` of section ``name`` (``KeyError`` for another name)."""
        return self._sections[name]

    def get(self, section: str, key: Any, build: Callable[[], Any], *, cache: bool = True) -> Any:
        """The value of ``key`` in ``section``: kept from an earlier call, or ``build()``
        (kept when ``cache``; with ``cache=False`` built every time, nothing kept:
        ``Settings.table_cache``)."""
        if not cache:
            return build()
        return self._sections[section].get(key, build)

    def clear(self) -> None:
        """Forget every value of every section."""
        for s in self._sections.values():
            s.clear()

    def __len__(self) -> int:
        return sum(len(s) for s in self._sections.values())

    def __repr__(self) -> str:
        return "BatchCache(" + ", ".join(f"{n}={len(s)}" for n, s in self._sections.items()) + ")"
