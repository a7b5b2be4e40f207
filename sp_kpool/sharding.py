"""``ShardedSequence``: which rows of a packed sequence this rank owns, in which layout.

A frozen value object built by pure functions: no communication happens here, except in
:meth:`ShardedSequence.from_positions`, which all-gathers every rank's positions once, and
in :meth:`ShardedSequence.global_rows`, a collective by design. Both collectives live
above the sequence, in :mod:`sp_kpool.comm`, which gives them to it at its import
(:func:`register_collectives`; ``import sp_kpool`` imports it): the sequence imports
nothing that uses it.

The sequence a user builds once per batch, in three modules: this one, the data type
(its fields, its constructors and the calls that move a rank's rows in and out,
``local_rows`` and ``global_rows``); :mod:`sp_kpool.sharding_maps`, the stream/real-row
tables of every layout (:class:`~sp_kpool.sharding_maps.RowMaps`, its base);
:mod:`sp_kpool.sharding_checks`, the checks of what the constructors take.

Picture (world size 3, documents of lengths 5 and 3, ``kpool`` 4, ``layout="contiguous"``)::

    stream tokens   0 1 2 3 4 | 5 6 7 | 8           cu_seq_lens = [0, 5, 8, 9]
                    doc 0       doc 1   padding     (padding doc appended: 8 -> 9)
    shards          [0 1 2] [3 4 5] [6 7 8]         3 rows per rank
    pools (doc 0)   [0 1 2 3] 4                     pool 0 straddles the seam 2|3

The **stream** is the user's documents with the padding documents the layout adds (each
its own document in ``cu_seq_lens``, so padding never mixes with real documents); the
layouts are listed in :mod:`sp_kpool.layouts`. ``positions`` are the stream positions of
this rank's rows in storage order: input rows and output rows follow them, and output ids
are stream positions. Rows of padding documents return all ``-1``.

Inside, the operator works on the **real rows**: the real documents packed without
padding (what a world-size-1 contiguous call on the same documents sees). Every table
of :mod:`sp_kpool.sharding_maps` maps between the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .batch import BatchCache, TableCache
from .checks import check_choice, check_int
from .layouts import LAYOUTS, stream_layout
from .op_arguments import sequence_arguments
from .sharding_checks import _as_cu_seq_lens, _as_positions, _as_prompt_lens, _check_cover  # noqa: F401 - _check_cover: importable from here
from .sharding_maps import RowMaps, row_runs  # noqa: F401 - row_runs: importable from here

__all__ = ["ShardedSequence"]


#: The sequence's two collectives, which live above it (:mod:`sp_kpool.comm`, which uses the
#: sequence): ``gather_positions`` (:meth:`ShardedSequence.from_positions`) and
#: ``global_rows`` (:meth:`ShardedSequence.global_rows`). :mod:`sp_kpool.comm` fills this at
#: its import, and ``sp_kpool/__init__`` imports it, so a sequence a user holds has them.
_COLLECTIVES: dict[str, Callable] = {}


def register_collectives(*, gather_positions: Callable, global_rows: Callable) -> None:
    """Give the sequence its collectives (:mod:`sp_kpool.comm`, at its import)."""
    _COLLECTIVES.update(gather_positions=gather_positions, global_rows=global_rows)


def _collective(name: str) -> Callable:
    fn = _COLLECTIVES.get(name)
    if fn is None:  # only while sp_kpool itself is being imported: sp_kpool/__init__ imports sp_kpool.comm
        raise RuntimeError(f"ShardedSequence: its collective {name!r} is not registered yet (import sp_kpool.comm)")
    return fn


@dataclass(frozen=True, eq=False)
class ShardedSequence(RowMaps):
    """A packed sequence and the rows of it that this rank owns.

    Attributes:
        cu_seq_lens: ``[num_docs + 1]``, int64, CPU. Document boundaries of the stream:
            the user's documents and the padding documents the layout added.
        shard_start: ``layout="contiguous"``: the stream position of this rank's first row
            (rows ``[shard_start, shard_start + shard_size)``); ``None`` in other layouts.
        shard_size: number of rows this rank owns (``S_local``; equal on every rank except
            with :meth:`from_positions`).
        rank, world_size: this rank and the number of ranks.
        group: the ``torch.distributed`` process group (``None`` means the default group
            when ``world_size > 1``, and no communication at all when ``world_size == 1``).
        num_padding: padding tokens in the stream.
        prompt_lens: the prompt length of every real document (a tuple of ints,
            ``0 <= P_d <= len_d``), or ``None``: the serving arithmetics then compress the
            pools closed inside the prompt in the extend order, the others in the decode
            order, as a single-turn rollout's prefill and decoding did
            (:func:`sp_kpool.pooling.extend_pools`); ``None`` (or all zero): every pool in
            decode order. The ``bf16`` model arithmetic has one order and ignores it.
        layout: ``"contiguous"``, ``"zigzag"``, ``"zigzag-per-document"`` or
            ``"positions"`` (see :mod:`sp_kpool.layouts`).
        padding_docs: indices of the padding documents in ``cu_seq_lens`` (``None``: the
            last document when ``num_padding > 0``, else none).
        rank_positions: per rank, int64 CPU ``[S_r]``, the stream positions of its rows in
            storage order (``None``: the contiguous shards).
        batch: the per-batch object (:class:`sp_kpool.batch.BatchCache`, made on
            construction, never replaced): what the pipeline derives from this sequence
            once (chunk plans and their tables, spans, row work, balance partitions);
            every layer called with this object after the first reuses it. Build one
            sequence per batch and pass it to every layer. :attr:`tables` is its plans.
    """

    cu_seq_lens: torch.Tensor
    shard_start: int | None
    shard_size: int
    rank: int
    world_size: int
    group: Any = None
    num_padding: int = 0
    prompt_lens: tuple[int, ...] | None = None
    layout: str = "contiguous"
    padding_docs: tuple[int, ...] | None = None
    rank_positions: tuple[torch.Tensor, ...] | None = field(default=None, repr=False)
    batch: BatchCache = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.padding_docs is None:
            n_docs = self.cu_seq_lens.numel() - 1
            object.__setattr__(self, "padding_docs", (n_docs - 1,) if self.num_padding else ())
        if self.rank_positions is None:
            s = self.shard_size
            object.__setattr__(self, "rank_positions",
                               tuple(torch.arange(r * s, (r + 1) * s) for r in range(self.world_size)))  # fmt: skip
        if self.prompt_lens is not None:  # validated and a tuple however the object was built
            object.__setattr__(self, "prompt_lens", _as_prompt_lens(self.prompt_lens, self.real_cu_seq_lens))
        object.__setattr__(self, "batch", BatchCache())
        # what the custom operator takes of it (sp_kpool.op_arguments)
        object.__setattr__(self, "op_arguments", sequence_arguments(self))

    # ----------------------------------------------------------------- builders
    @classmethod
    def split(
        cls,
        cu_seq_lens: torch.Tensor | Sequence[int],
        world_size: int,
        rank: int,
        group: Any = None,
        *,
        layout: str = "contiguous",
        pad_multiple: int | None = None,
        prompt_lens: Sequence[int] | None = None,
    ) -> "ShardedSequence":
        """Lay the packed sequence ``cu_seq_lens`` out over ``world_size`` ranks.

        Args:
            cu_seq_lens: ``[num_docs + 1]`` integer tensor or list, starting at 0,
                non-decreasing (empty documents are allowed), total length >= 1.
            world_size: number of ranks, >= 1.
            rank: this rank, in ``[0, world_size)``.
            group: process group used by collectives (not queried here).
            layout: ``"contiguous"`` (equal shards, the total padded at the end to a
                multiple of ``world_size``), ``"zigzag"`` or ``"zigzag-per-document"``
                (see :mod:`sp_kpool.layouts`).
            pad_multiple: ``"zigzag-per-document"`` only: pad every document to a multiple
                of this (a multiple of ``2 * world_size``) instead of ``2 * world_size``.
            prompt_lens: one prompt length per document of ``cu_seq_lens``
                (``0 <= P_d <= len_d``), or ``None`` (see the attribute). Every rank must
                pass the same values (checked by the operator's agreement).

        Raises ``ValueError``/``TypeError`` naming the argument and the bad value.
        """
        world_size = check_int("world_size", world_size, 1)
        rank = check_int("rank", rank)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size = {world_size}, got {rank}")
        check_choice("layout", layout, LAYOUTS)
        cu = _as_cu_seq_lens(cu_seq_lens)
        lay = stream_layout(cu, world_size, layout, pad_multiple)
        stream = lay.cu_seq_lens
        num_padding = int(sum(int(stream[d + 1] - stream[d]) for d in lay.padding_docs))
        size = lay.positions[rank].numel()
        contiguous = layout == "contiguous"
        return cls(
            cu_seq_lens=stream,
            shard_start=rank * size if contiguous else None,
            shard_size=size,
            rank=rank,
            world_size=world_size,
            group=group,
            num_padding=num_padding,
            prompt_lens=prompt_lens,
            layout=layout,
            padding_docs=lay.padding_docs,
            rank_positions=None if contiguous else lay.positions,
        )

    @classmethod
    def from_group(cls, cu_seq_lens: torch.Tensor | Sequence[int], group: Any = None,
                   prompt_lens: Sequence[int] | None = None, *, layout: str = "contiguous",
                   pad_multiple: int | None = None) -> "ShardedSequence":  # fmt: skip
        """Like :meth:`split`, with rank and world size read from ``group``.

        Without an initialized default process group this is world size 1, rank 0.
        """
        world_size, rank = _group_rank(group)
        return cls.split(cu_seq_lens, world_size, rank, group, layout=layout, pad_multiple=pad_multiple,
                         prompt_lens=prompt_lens)  # fmt: skip

    @classmethod
    def from_positions(
        cls,
        cu_seq_lens: torch.Tensor | Sequence[int],
        positions: torch.Tensor | Sequence[int],
        *,
        world_size: int,
        rank: int,
        group: Any = None,
        prompt_lens: Sequence[int] | None = None,
    ) -> "ShardedSequence":
        """Any ownership: this rank holds the rows at ``positions`` of ``cu_seq_lens``.

        Args:
            cu_seq_lens: ``[num_docs + 1]`` document boundaries (as in :meth:`split`); no
                padding is added, so every position is a real token.
            positions: ``[S_local]`` integer tensor or list, distinct stream positions in
                ``[0, cu_seq_lens[-1])``, in this rank's row order. Sizes may differ per
                rank; the union over the ranks must be exactly the whole sequence.
            world_size, rank, group: as in :meth:`split`.
            prompt_lens: as in :meth:`split`.

        With ``world_size > 1`` this all-gathers every rank's positions over ``group``
        (once; the operator needs them to place the gathered keys) and checks them on
        every rank alike: a rank's bad input, or a position owned twice or by no rank,
        raises the same ``ValueError`` on every rank, naming it. :meth:`from_rank_positions`
        is the same without communication, for callers that know every rank's positions.
        """
        world_size = check_int("world_size", world_size, 1)
        rank = check_int("rank", rank)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size = {world_size}, got {rank}")
        if world_size == 1:
            return cls.from_rank_positions(cu_seq_lens, [positions], rank=0, group=group, prompt_lens=prompt_lens)
        gather_positions = _collective("gather_positions")  # sp_kpool.comm.gather_positions
        error, pos = None, torch.zeros(0, dtype=torch.int64)
        try:
            cu = _as_cu_seq_lens(cu_seq_lens)
            pos = _as_positions("positions", positions, int(cu[-1]))
        except (TypeError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        everyone = gather_positions(pos, error, world_size=world_size, rank=rank, group=group)
        return cls.from_rank_positions(cu, everyone, rank=rank, group=group, prompt_lens=prompt_lens)

    @classmethod
    def from_rank_positions(cls, cu_seq_lens: torch.Tensor | Sequence[int], rank_positions: Sequence[Any], *,
                            rank: int, group: Any = None,
                            prompt_lens: Sequence[int] | None = None) -> "ShardedSequence":  # fmt: skip
        """:meth:`from_positions` given every rank's positions (``rank_positions[r]`` for
        rank ``r``; the world size is their count), without communication."""
        cu = _as_cu_seq_lens(cu_seq_lens)
        total = int(cu[-1])
        world_size = len(rank_positions)
        rank = check_int("rank", rank)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size = {world_size}, got {rank}")
        pos = tuple(_as_positions(f"positions (rank {r})", p, total) for r, p in enumerate(rank_positions))
        _check_cover(pos, total)
        return cls(cu_seq_lens=cu, shard_start=None, shard_size=pos[rank].numel(), rank=rank, world_size=world_size,
                   group=group, prompt_lens=prompt_lens, layout="positions", padding_docs=(),
                   rank_positions=pos)  # fmt: skip

    # ----------------------------------------------------------------- derived
    @property
    def tables(self) -> TableCache:
        """The chunk plans and their device tables kept for this sequence (the ``plans``
        section of :attr:`batch`; ``len()`` counts them, ``clear()`` forgets them)."""
        return self.batch.tables

    @property
    def total_length(self) -> int:
        """Length ``S`` of the stream (padding included)."""
        return int(self.cu_seq_lens[-1])

    @property
    def num_real_tokens(self) -> int:
        """Tokens of the real documents (the stream without its padding)."""
        return self.total_length - self.num_padding

    @property
    def is_contiguous(self) -> bool:
        """Rank ``r`` owns stream rows ``[r * S_local, (r + 1) * S_local)`` and the padding, if
        any, is at the end (real rows = stream rows): the layout the fast paths assume."""
        return self.layout == "contiguous"

    @property
    def shard_end(self) -> int | None:
        return None if self.shard_start is None else self.shard_start + self.shard_size

    @property
    def positions(self) -> torch.Tensor:
        """``[S_local]`` int64 CPU: the stream positions of this rank's rows, storage order."""
        return self.rank_positions[self.rank]

    # ----------------------------------------------------------------- a rank's rows
    # (the stream <-> real-row tables they use: RowMaps, sp_kpool.sharding_maps)
    def local_rows(self, x: torch.Tensor, fill: float | int | bool = 0) -> torch.Tensor:
        """This rank's rows of a global per-token tensor, in storage order.

        Args:
            x: ``[num_real_tokens, ...]``, any dtype and device: one row per real token of
                the user's documents, packed without padding, in document order (what a
                world-size-1 call on the same documents takes).
            fill: the value of the padding rows (:attr:`padding_rows`).

        Returns:
            ``[S_local, ...]``, ``x``'s dtype and device: row ``i`` is the token at stream
            position ``positions[i]``, the input of :func:`sp_kpool.kpool_topk` on this
            rank, whatever the layout (padding per document in ``zigzag-per-document``,
            at the end in ``contiguous``, none with :meth:`from_positions`). No
            communication. :meth:`global_rows` is the inverse.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor [num_real_tokens, ...], got {type(x).__name__}")
        if x.dim() < 1 or x.shape[0] != self.num_real_tokens:
            raise ValueError(f"x: expected shape [{self.num_real_tokens}, ...] (one row per real token: "
                             f"seq.num_real_tokens), got {list(x.shape)}")  # fmt: skip
        out = x.new_full((self.shard_size, *x.shape[1:]), fill)
        dev = x.device
        out[self.storage_index().to(dev)] = x[self.real_rows().to(dev)]
        return out

    def global_rows(self, rows: torch.Tensor, *, timeout: float | None = None) -> torch.Tensor:
        """Every rank's rows back as one global per-token tensor: the inverse of
        :meth:`local_rows`.

        A collective over ``group``: every rank of the sequence must call it, with rows of
        the same dtype and trailing shape (checked first, on every rank alike, like the
        operator's agreement). With world size 1 and no group it is local.

        Args:
            rows: ``[S_local, ...]``: this rank's rows in storage order (e.g. the ids
                :func:`sp_kpool.kpool_topk` returned, or ``seq.real_ids`` of them).
                Padding rows are dropped.
            timeout: seconds to wait for the other ranks (default: the settings'
                ``comm_timeout``).

        Returns:
            ``[num_real_tokens, ...]`` on ``rows.device``, in real-token order (the rows of
            a world-size-1 call on the same documents).
        """
        return _collective("global_rows")(self, rows, timeout=timeout)  # sp_kpool.comm.global_rows

    @property
    def has_prompts(self) -> bool:
        """Whether some pool is compressed in the extend order (a prompt of >= 1 pool)."""
        return self.prompt_lens is not None and any(p > 0 for p in self.prompt_lens)

    def __repr__(self) -> str:  # tensors make the default repr noisy
        prompts = "" if self.prompt_lens is None else f", prompt_lens={list(self.prompt_lens)}"
        rows = (f"shard=[{self.shard_start}, {self.shard_end})" if self.is_contiguous
                else f"layout={self.layout!r}, rows={self.shard_size}")  # fmt: skip
        return (
            f"ShardedSequence(num_docs={self.cu_seq_lens.numel() - 1}, total={self.total_length}, "
            f"num_padding={self.num_padding}, rank={self.rank}/{self.world_size}, {rows}{prompts})"
        )


def _group_rank(group: Any) -> tuple[int, int]:
    """``(world_size, rank)`` of ``group``; ``(1, 0)`` without torch.distributed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group), dist.get_rank(group)
    if group is not None:
        raise ValueError("group: a process group was given but torch.distributed is not initialized")
    return 1, 0
