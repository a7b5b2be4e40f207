"""``sp_kpool::kpool_topk``: the operator as one opaque PyTorch custom operator (``torch.library``).

``torch.compile`` does not trace into the operator: :func:`sp_kpool.kpool_topk` and
``KPoolIndexer.forward``, called while TorchDynamo traces (``torch.compiler.is_compiling()``),
emit one call of ``torch.ops.sp_kpool.kpool_topk``, whose fake (meta) implementation gives the
output ``[S_local, width]`` int32 (``S_local = q.shape[0]``, ``width`` from the config), so a
model with the indexer inside compiles with ``fullgraph=True`` and dynamic shapes: a new
sequence length, a new document split or a new :class:`~sp_kpool.sharding.ShardedSequence`
does not recompile. The collectives (the agreement, the gathers, the balance's exchanges)
run inside the operator, eagerly, exactly as in an eager call: the ids are the eager ids.

A ``ShardedSequence`` (and its process group) cannot be an operator argument. The operator
takes its **tensors** (one table of ``cu_seq_lens``, the padding documents and the prompt
lengths, and, in the interleaved layouts, every rank's positions: CPU int64, shapes dynamic) and its
**constants** (world size, rank, layout and the process group's **name**, resolved inside as
``torch.distributed``'s functional collectives resolve theirs). :class:`SequenceArguments`
(:mod:`sp_kpool.op_arguments`, below the sequence) holds them; every ``ShardedSequence``
computes its own once, on construction (``seq.op_arguments``), outside any traced code. Inside, the sequence is rebuilt from these
values and kept in a small cache keyed by them, so every layer of one batch reuses one
sequence object and with it its per-batch object (``seq.batch``: the tables, spans,
partitions). The call's :class:`~sp_kpool.config.KPoolConfig` and
:class:`~sp_kpool.config.RunOptions` travel as scalars and strings (constants of the
graph, the same on every call of a module), with ``precision``, ``max_logits_bytes`` and
``check_finite`` resolved before the call, and the call's
:class:`~sp_kpool.settings.Settings` as the reprs of its fields, one a line
(``Settings.op_text``, made on construction; a constant too).

Eager calls (outside a trace) keep the direct path of :func:`sp_kpool.pipeline.run`: its
checks, messages and agreement are unchanged, and a bad argument (``seq`` that is no
``ShardedSequence``, a tensor that is no tensor) is reported as before, not by the
dispatcher's schema check.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import threading
from collections import OrderedDict
from typing import Any, List, Optional

import torch

from . import pipeline
from .config import KPoolConfig, RunOptions, output_width
from .op_arguments import SequenceArguments, _resolve_group, sequence_arguments
from .settings import Settings, current_settings
from .sharding import ShardedSequence

__all__ = ["SequenceArguments", "sequence_arguments", "kpool_topk_traced", "OP_NAME", "is_traced"]

#: The operator's qualified name: ``torch.ops.sp_kpool.kpool_topk``.
OP_NAME = "sp_kpool::kpool_topk"


_SEQS: "OrderedDict[tuple, Any]" = OrderedDict()
_SEQS_MAX = 8
_LOCK = threading.Lock()


def _sequence(documents, rank_positions, world_size, rank, group_name, layout):
    """The ``ShardedSequence`` of these values (cached: one object, one table cache, per
    sequence; at most :data:`_SEQS_MAX`)."""

    def raw(t):
        return t.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()

    key = (layout, world_size, rank, group_name, tuple(documents.shape), raw(documents),
           tuple(raw(p) for p in rank_positions) if layout == "positions" else len(rank_positions))  # fmt: skip
    with _LOCK:
        seq = _SEQS.get(key)
        if seq is not None:
            _SEQS.move_to_end(key)
            return seq
    table = documents.detach().to("cpu", torch.int64)
    cu = table[0].clone()
    stream = cu.tolist()
    pad = tuple(d for d, p in enumerate(table[1, :-1].tolist()) if p)
    prompts = None if table.shape[0] < 3 else tuple(p for d, p in enumerate(table[2, :-1].tolist()) if d not in pad)
    num_padding = sum(stream[d + 1] - stream[d] for d in pad)
    positions = None if layout == "contiguous" else tuple(p.detach().to("cpu", torch.int64) for p in rank_positions)
    size = stream[-1] // world_size if positions is None else int(positions[rank].numel())
    seq = ShardedSequence(
        cu_seq_lens=cu, shard_start=rank * size if positions is None else None, shard_size=size, rank=rank,
        world_size=world_size, group=_resolve_group(group_name), num_padding=num_padding, prompt_lens=prompts,
        layout=layout, padding_docs=pad, rank_positions=positions,
    )  # fmt: skip
    with _LOCK:
        _SEQS[key] = seq
        while len(_SEQS) > _SEQS_MAX:
            _SEQS.popitem(last=False)
    return seq


#: The :class:`~sp_kpool.settings.Settings` fields, in the order the operator takes their reprs.
SETTINGS_FIELDS = tuple(f.name for f in dataclasses.fields(Settings))


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):  # inf, nan
        return float(text)


@functools.lru_cache(maxsize=16)
def _settings(text: str) -> Settings:
    """The call's :class:`~sp_kpool.settings.Settings` from the reprs of its fields, one a line."""
    return Settings(**{name: _literal(v) for name, v in zip(SETTINGS_FIELDS, text.split("\n"))})


def _opt(value: int) -> int | None:
    return None if value < 0 else value


def _tags() -> dict:
    """``cudagraph_unsafe`` where this torch has it (Inductor then leaves the operator out of
    its CUDA graphs: it reads the host and communicates; README, 'CUDA graphs')."""
    import inspect

    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    if tag is None or "tags" not in inspect.signature(torch.library.custom_op).parameters:
        return {}
    return {"tags": (tag,)}


@torch.library.custom_op(OP_NAME, mutates_args=(), **_tags())
def _kpool_topk_op(
    q: torch.Tensor,
    k: torch.Tensor,
    gates: torch.Tensor,
    head_weights: torch.Tensor,
    ape: torch.Tensor,
    documents: torch.Tensor,
    rank_positions: List[torch.Tensor],
    world_size: int,
    rank: int,
    group_name: str,
    layout: str,
    topk: int,
    kpool: int,
    tail: str,
    order: str,
    alignment: int,
    precision: str,
    max_logits_bytes: int,
    backend: str,
    gather: str,
    balance: str,
    balance_block: int,
    balance_row_cost: int,
    check_finite: bool,
    settings: str,
    rows: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    seq = _sequence(documents, rank_positions, world_size, rank, group_name, layout)
    config = KPoolConfig(topk=topk, kpool=kpool, tail=tail, order=order, alignment=alignment, precision=precision,
                         max_logits_bytes=max_logits_bytes)  # fmt: skip
    options = RunOptions(backend=backend, gather=gather, balance=balance, balance_block=_opt(balance_block),
                         balance_row_cost=_opt(balance_row_cost), check_finite=check_finite)  # fmt: skip
    return pipeline.run(q, k, gates, head_weights, ape, seq, config, options, settings=_settings(settings), rows=rows)


@_kpool_topk_op.register_fake
def _kpool_topk_fake(q, k, gates, head_weights, ape, documents, rank_positions, world_size, rank, group_name, layout,
                     topk, kpool, tail, order, alignment, *rest):  # fmt: skip
    return q.new_empty((q.shape[0], output_width(topk, kpool, alignment)), dtype=torch.int32)


def is_traced() -> bool:
    """Whether TorchDynamo is tracing the caller (the custom-operator path)."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


@torch.compiler.assume_constant_result
def _process_settings(device_type: str) -> tuple[str, int, bool, str]:
    """What a traced call takes of the process settings (:func:`~sp_kpool.settings.current_settings`)
    for tensors on ``device_type``: ``(precision, logits budget, check_finite, op_text)``.
    TorchDynamo calls this when it traces and keeps the result as a constant of the graph,
    without a guard on the settings' cache: traced through instead, the first compiled call
    that is the process's first read of the settings fills the cache inside the trace, and
    the guard of that trace (an empty cache) fails at the next call, which compiles a second
    frame. The settings are read once per process, so the constant is exact."""
    s = current_settings()
    return s.precision, s.logits_budget(device_type), s.check_finite, s.op_text


def kpool_topk_traced(q, k, gates, head_weights, ape, seq, config: KPoolConfig, options: RunOptions,
                      settings: Settings | None, rows: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """One call of ``torch.ops.sp_kpool.kpool_topk`` for :func:`sp_kpool.kpool_topk` under a
    trace (``config`` and ``options`` already built; ``settings`` the call's, ``None``: the
    process settings, read as a constant of the graph, :func:`_process_settings`; ``rows``
    the ``rows=`` tensor, checked inside the operator like the other inputs)."""
    args = getattr(seq, "op_arguments", None)
    if not isinstance(args, SequenceArguments):
        raise TypeError(f"seq: expected a ShardedSequence, got {type(seq).__name__}")
    if settings is None:
        precision, budget, default_check_finite, settings_text = _process_settings(q.device.type)
        config = config.replace(precision=config.precision or precision,
                                max_logits_bytes=config.max_logits_bytes or budget)  # fmt: skip
    else:
        config = config.resolve(settings, q.device)
        default_check_finite, settings_text = settings.check_finite, settings.op_text
    check_finite = default_check_finite if options.check_finite is None else options.check_finite
    return torch.ops.sp_kpool.kpool_topk(
        q, k, gates, head_weights, ape, args.documents, list(args.rank_positions), args.world_size, args.rank, args.group_name, args.layout,
        config.topk, config.kpool, config.tail, config.order, config.alignment, config.precision,
        config.max_logits_bytes, options.backend, options.gather, options.balance,
        -1 if options.balance_block is None else options.balance_block,
        -1 if options.balance_row_cost is None else options.balance_row_cost, bool(check_finite),
        settings_text, rows,
    )  # fmt: skip
