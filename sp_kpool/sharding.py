"""``ShardedSequence``: which query rows of a packed sequence this rank owns.

A frozen value object built by pure functions: no communication happens here.

Picture (world size 3, documents of lengths 5 and 3, ``kpool`` 4)::

    global tokens   0 1 2 3 4 | 5 6 7 | 8           cu_seq_lens = [0, 5, 8, 9]
                    doc 0       doc 1   padding     (padding doc appended: 8 -> 9)
    shards          [0 1 2] [3 4 5] [6 7 8]         shard_size = 3
    pools (doc 0)   [0 1 2 3] 4                     pool 0 straddles the seam 2|3

The global length is padded up to a multiple of ``world_size``; the padding is its own
document at the end of ``cu_seq_lens`` so it can never mix with real documents. Rows of
the padding document return all ``-1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .checks import check_int, check_int_list

__all__ = ["ShardedSequence"]


def _as_cu_seq_lens(cu_seq_lens: Any) -> torch.Tensor:
    """Validate ``cu_seq_lens`` and return it as a CPU int64 tensor ``[num_docs + 1]``."""
    if type(cu_seq_lens).__module__ == "numpy" and hasattr(cu_seq_lens, "dtype"):  # an array: as a tensor
        if cu_seq_lens.dtype.kind not in "iu":
            raise TypeError(f"cu_seq_lens: expected an integer array, got dtype {cu_seq_lens.dtype}")
        cu_seq_lens = torch.as_tensor(cu_seq_lens.astype("int64"))
    if isinstance(cu_seq_lens, torch.Tensor):
        if cu_seq_lens.dtype.is_floating_point or cu_seq_lens.dtype.is_complex or cu_seq_lens.dtype == torch.bool:
            raise TypeError(f"cu_seq_lens: expected an integer tensor, got dtype {cu_seq_lens.dtype}")
        cu = cu_seq_lens.detach().to("cpu", torch.int64)
    else:
        cu = torch.tensor(check_int_list("cu_seq_lens", cu_seq_lens), dtype=torch.int64)
    if cu.dim() != 1:
        raise ValueError(f"cu_seq_lens: expected a 1-D tensor [num_docs + 1], got shape {tuple(cu.shape)}")
    if cu.numel() < 2:
        raise ValueError(f"cu_seq_lens: expected at least 2 entries [0, len], got {cu.tolist()}")
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seq_lens: expected cu_seq_lens[0] == 0, got {int(cu[0])}")
    diffs = cu[1:] - cu[:-1]
    if bool((diffs < 0).any()):
        i = int(torch.nonzero(diffs < 0)[0])
        raise ValueError(
            f"cu_seq_lens: expected non-decreasing values, got cu_seq_lens[{i}] = {int(cu[i])} > "
            f"cu_seq_lens[{i + 1}] = {int(cu[i + 1])}"
        )
    if int(cu[-1]) < 1:
        raise ValueError(f"cu_seq_lens: expected a total length >= 1, got {int(cu[-1])}")
    return cu


def _as_prompt_lens(prompt_lens: Any, cu: torch.Tensor) -> tuple[int, ...] | None:
    """``prompt_lens`` validated against the documents of ``cu`` (a tuple), or ``None``."""
    if prompt_lens is None:
        return None
    if getattr(prompt_lens, "ndim", 1) != 1:  # a tensor or an array
        raise TypeError(f"prompt_lens: expected a 1-D integer tensor or a list of ints, got shape "
                        f"{list(prompt_lens.shape)}")  # fmt: skip
    values = check_int_list("prompt_lens", prompt_lens)
    from .pooling import extend_pools

    extend_pools(cu, values, 1)  # checks the count and every value (one rule for both)
    return tuple(values)


@dataclass(frozen=True, eq=False)
class ShardedSequence:
    """A packed sequence split into equal contiguous query shards, one per rank.

    Attributes:
        cu_seq_lens: ``[num_docs + 1]``, int64, CPU. Global document boundaries, padded:
            when the real length is not a multiple of ``world_size`` the last entry is a
            padding document of ``num_padding`` tokens.
        shard_start: global id of this rank's first query row.
        shard_size: number of query rows each rank owns (``S_local``), equal on all ranks.
        rank, world_size: this rank and the number of ranks.
        group: the ``torch.distributed`` process group (``None`` means the default group
            when ``world_size > 1``, and no communication at all when ``world_size == 1``).
        num_padding: padding tokens at the end (``0 <= num_padding < world_size``).
        prompt_lens: the prompt length of every real document (a tuple of ints,
            ``0 <= P_d <= len_d``), or ``None``: the serving arithmetics then compress the
            pools closed inside the prompt in the extend order, the others in the decode
            order, as a single-turn rollout's prefill and decoding did
            (:func:`sp_kpool.pooling.extend_pools`); ``None`` (or all zero): every pool in
            decode order. The ``bf16`` model arithmetic has one order and ignores it.
        tables: the pipeline's tables for this sequence (:class:`sp_kpool.plan.TableCache`):
            every layer called with this object after the first reuses them.
    """

    cu_seq_lens: torch.Tensor
    shard_start: int
    shard_size: int
    rank: int
    world_size: int
    group: Any = None
    num_padding: int = 0
    prompt_lens: tuple[int, ...] | None = None
    tables: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        from .plan import TableCache

        if self.prompt_lens is not None:  # validated and a tuple however the object was built
            object.__setattr__(self, "prompt_lens", _as_prompt_lens(self.prompt_lens, self.real_cu_seq_lens))
        object.__setattr__(self, "tables", TableCache())

    # ----------------------------------------------------------------- builders
    @classmethod
    def split(
        cls,
        cu_seq_lens: torch.Tensor | Sequence[int],
        *,
        world_size: int,
        rank: int,
        group: Any = None,
        prompt_lens: Sequence[int] | None = None,
    ) -> "ShardedSequence":
        """Split the packed sequence ``cu_seq_lens`` into ``world_size`` equal shards.

        Args:
            cu_seq_lens: ``[num_docs + 1]`` integer tensor or list, starting at 0,
                non-decreasing (empty documents are allowed), total length >= 1.
            world_size: number of ranks, >= 1.
            rank: this rank, in ``[0, world_size)``.
            group: process group used by collectives (not queried here).
            prompt_lens: one prompt length per document of ``cu_seq_lens``
                (``0 <= P_d <= len_d``), or ``None`` (see the attribute). Every rank must
                pass the same values (checked by the operator's agreement).

        Raises ``ValueError``/``TypeError`` naming the argument and the bad value.
        """
        world_size = check_int("world_size", world_size, 1)
        rank = check_int("rank", rank)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size = {world_size}, got {rank}")
        cu = _as_cu_seq_lens(cu_seq_lens)
        total = int(cu[-1])
        padded = -(-total // world_size) * world_size
        num_padding = padded - total
        if num_padding:
            cu = torch.cat([cu, cu.new_tensor([padded])])
        shard_size = padded // world_size
        return cls(
            cu_seq_lens=cu,
            shard_start=rank * shard_size,
            shard_size=shard_size,
            rank=rank,
            world_size=world_size,
            group=group,
            num_padding=num_padding,
            prompt_lens=prompt_lens,
        )

    @classmethod
    def from_group(cls, cu_seq_lens: torch.Tensor | Sequence[int], group: Any = None,
                   prompt_lens: Sequence[int] | None = None) -> "ShardedSequence":  # fmt: skip
        """Like :meth:`split`, with rank and world size read from ``group``.

        Without an initialized default process group this is world size 1, rank 0.
        """
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size(group)
            rank = dist.get_rank(group)
        elif group is not None:
            raise ValueError("group: a process group was given but torch.distributed is not initialized")
        else:
            world_size, rank = 1, 0
        return cls.split(cu_seq_lens, world_size=world_size, rank=rank, group=group, prompt_lens=prompt_lens)

    # ----------------------------------------------------------------- derived
    @property
    def total_length(self) -> int:
        """Padded global length ``S`` (``world_size * shard_size``)."""
        return int(self.cu_seq_lens[-1])

    @property
    def num_real_tokens(self) -> int:
        """Global length without the padding document."""
        return self.total_length - self.num_padding

    @property
    def real_cu_seq_lens(self) -> torch.Tensor:
        """``cu_seq_lens`` without the padding document, int64 CPU."""
        return self.cu_seq_lens[:-1] if self.num_padding else self.cu_seq_lens

    @property
    def shard_end(self) -> int:
        return self.shard_start + self.shard_size

    @property
    def has_prompts(self) -> bool:
        """Whether some pool is compressed in the extend order (a prompt of >= 1 pool)."""
        return self.prompt_lens is not None and any(p > 0 for p in self.prompt_lens)

    def __repr__(self) -> str:  # tensors make the default repr noisy
        prompts = "" if self.prompt_lens is None else f", prompt_lens={list(self.prompt_lens)}"
        return (
            f"ShardedSequence(num_docs={self.cu_seq_lens.numel() - 1}, total={self.total_length}, "
            f"num_padding={self.num_padding}, rank={self.rank}/{self.world_size}, "
            f"shard=[{self.shard_start}, {self.shard_end}){prompts})"
        )
