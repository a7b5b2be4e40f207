"""What the custom operator (:mod:`sp_kpool.op`) takes of a ``ShardedSequence``.

A ``ShardedSequence`` (and its process group) cannot be an argument of
``torch.ops.sp_kpool.kpool_topk``: the operator takes its tensors and constants,
:class:`SequenceArguments`, which every sequence computes once, on construction
(``seq.op_arguments``, outside any traced code), and rebuilds the sequence from them
inside. The process group travels as its name (:func:`_group_name`) and is resolved back
inside (:func:`_resolve_group`). Only torch and the sequence's own fields: this sits below
the sequence, which calls it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["SequenceArguments", "sequence_arguments"]


class SequenceArguments(NamedTuple):
    """What the custom operator takes of a ``ShardedSequence`` (computed on construction).

    documents: ``[2, num_docs + 1]`` int64 CPU (``[3, ...]`` with prompt lengths): row 0 the
        stream's ``cu_seq_lens``; row 1 ``1`` at the padding documents; row 2 the prompt
        length of each real document (``-1`` at padding documents). One tensor of at least
        two columns, so that its size stays symbolic (sizes 0 and 1 are specialized).
    rank_positions: every rank's ``[S_r]`` int64 CPU stream positions (empty for the
        contiguous layout, whose shards follow from ``cu_seq_lens`` and the world size).
    world_size, rank: of the sequence. group_name: the process group's name (``""``: the
        default group, or none at world size 1). layout: the layout's name.
    """

    documents: torch.Tensor
    rank_positions: tuple
    world_size: int
    rank: int
    group_name: str
    layout: str


def _group_name(group: Any) -> str:
    if group is None:
        return ""
    name = getattr(group, "group_name", None)
    if isinstance(name, str) and name:
        return name
    try:
        from torch.distributed.distributed_c10d import _get_process_group_name

        return _get_process_group_name(group)
    except Exception:  # noqa: BLE001 - a group we cannot name: the traced path refuses it
        return "<unnamed>"


def sequence_arguments(seq: Any) -> SequenceArguments:
    """The :class:`SequenceArguments` of ``seq`` (no communication)."""
    cu = seq.cu_seq_lens
    n_docs = cu.numel() - 1
    rows = [cu.to(torch.int64), torch.zeros(n_docs + 1, dtype=torch.int64)]
    rows[1][list(seq.padding_docs or ())] = 1
    if seq.prompt_lens is not None:
        prompts = torch.full((n_docs + 1,), -1, dtype=torch.int64)
        real = [d for d in range(n_docs) if d not in set(seq.padding_docs or ())]
        prompts[real] = torch.tensor(list(seq.prompt_lens), dtype=torch.int64)
        rows.append(prompts)
    return SequenceArguments(
        documents=torch.stack(rows),
        rank_positions=() if seq.layout == "contiguous" else tuple(seq.rank_positions),
        world_size=int(seq.world_size),
        rank=int(seq.rank),
        group_name=_group_name(seq.group),
        layout=seq.layout,
    )


def _resolve_group(name: str) -> Any:
    if name == "":
        return None
    if name == "<unnamed>":
        raise ValueError("seq.group: a process group without a name cannot cross a torch.compile graph; "
                         "use a group created by torch.distributed (new_group, init_process_group, a DeviceMesh)")  # fmt: skip
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)
