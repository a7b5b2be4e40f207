"""The checks of what a ``ShardedSequence`` is built from.

:meth:`~sp_kpool.sharding.ShardedSequence.split`, ``from_positions`` and
``from_rank_positions`` take ``cu_seq_lens``, prompt lengths and positions as tensors, NumPy
arrays or lists; these return them as CPU int64 (or a tuple), or raise ``TypeError`` /
``ValueError`` naming the argument and the bad value. :func:`_check_cover`: every stream
position owned by exactly one rank.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .checks import check_int_list
from .pooling import extend_pools

__all__: list[str] = []


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
    extend_pools(cu, values, 1)  # checks the count and every value (one rule for both)
    return tuple(values)


def _as_positions(name: str, positions: Any, total: int) -> torch.Tensor:
    """``positions`` as a 1-D int64 CPU tensor of values in ``[0, total)`` (a tensor, a NumPy
    array or a list of integer-like values)."""
    if isinstance(positions, torch.Tensor) and not (positions.dtype.is_floating_point or positions.dtype.is_complex
                                                    or positions.dtype == torch.bool):  # fmt: skip
        if positions.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got shape {list(positions.shape)}")
        pos = positions.detach().to("cpu", torch.int64)
    else:
        pos = torch.tensor(check_int_list(name, positions), dtype=torch.int64)
    bad = (pos < 0) | (pos >= total)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise ValueError(f"{name}: expected stream positions in [0, {total}), got {int(pos[i])} at index {i}")
    return pos


def _check_cover(rank_positions: Sequence[torch.Tensor], total: int) -> None:
    """Every stream position in exactly one rank's positions (``ValueError`` naming the first
    missing or repeated one)."""
    counts = torch.zeros(total, dtype=torch.int64)
    for p in rank_positions:
        counts.index_add_(0, p, torch.ones_like(p))
    if bool((counts > 1).any()):
        t = int(torch.nonzero(counts > 1)[0])
        ranks = [r for r, p in enumerate(rank_positions) if bool((p == t).any())]
        raise ValueError(f"positions: stream position {t} is owned more than once (ranks {ranks})")
    if bool((counts == 0).any()):
        t = int(torch.nonzero(counts == 0)[0])
        raise ValueError(f"positions: stream position {t} of [0, {total}) is owned by no rank "
                         f"({int((counts == 0).sum())} missing)")  # fmt: skip
