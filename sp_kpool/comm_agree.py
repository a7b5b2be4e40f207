"""The agreement: bad input on any rank fails on every rank alike, before data moves.

:func:`agree_or_raise` all-gathers one small vector per call: every rank's error code and a
signature of named integers that must be equal everywhere (shapes, options, digests;
:func:`tensor_codes` for the dtype and device type of tensors), then every rank raises the
same exception naming the failing or disagreeing ranks, and, for a list behind a digest
(:class:`Listed`), the first entry that differs. :mod:`sp_kpool.agreement` builds the
operator's signature on it; the waits are :mod:`sp_kpool.comm_wait`'s.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .comm_wait import CommStats, _all_gather_timed, _nbytes, comm_device
from .settings import DEFAULT_COMM_LOG_INTERVAL, DEFAULT_COMM_TIMEOUT

__all__ = ["Listed", "agree_or_raise", "tensor_codes"]


#: Exception types the agreement carries from a rank to every rank (code: index + 1; 0:
#: no error). Any other exception of a rank's checks travels as ``RuntimeError``.
_ERROR_TYPES = (ValueError, TypeError, RuntimeError)


def _error_code(error) -> int:
    if error is None:
        return 0
    if isinstance(error, str):
        return 1
    return next((i + 1 for i, t in enumerate(_ERROR_TYPES) if isinstance(error, t)), len(_ERROR_TYPES))


class Listed:
    """The third element of an agreement entry whose value is a digest (a crc32) of a list
    of integers: the list itself, so that a disagreement names the first entry that differs
    and each rank's value there, not only the digests.

    ``name``: what the list is called in the message (``cu_seq_lens``); ``values``: a 1-D
    integer tensor, a sequence of ints, ``None`` (no list), or a callable returning one of
    these (called only when the ranks disagree); ``label(first, i)``: the name of entry
    ``i`` given the lowest rank's list ``first`` (default ``name[i]``). The lists move in
    one more pair of all-gathers, on the error path only."""

    __slots__ = ("name", "values", "label")

    def __init__(self, name: str, values, label=None) -> None:
        self.name, self.values, self.label = name, values, label

    def tensor(self) -> torch.Tensor | None:
        v = self.values() if callable(self.values) else self.values
        return None if v is None else torch.as_tensor(v, dtype=torch.int64).flatten().cpu()


def _gather_listed(seq, listed: list[Listed], timeout: float) -> list[list[list[int] | None]]:
    """For each of ``listed``, every rank's list (``None``: the rank has none): one
    all-gather of the lengths, one of the lists padded to the longest."""
    mine = [x.tensor() for x in listed]
    dev = comm_device(seq)
    lens = torch.tensor([-1 if t is None else t.numel() for t in mine], dtype=torch.int64)
    all_lens = _all_gather_timed(lens.to(dev), seq, timeout, "agreement (the lists that differ)").cpu()
    widths = [max(0, int(all_lens[:, j].max())) for j in range(len(listed))]
    buf = torch.zeros(max(1, sum(widths)), dtype=torch.int64)
    at = 0
    for t, w in zip(mine, widths):
        if t is not None:
            buf[at : at + t.numel()] = t
        at += w
    allv = _all_gather_timed(buf.to(dev), seq, timeout, "agreement (the lists that differ)").cpu()
    out, at = [], 0
    for j, w in enumerate(widths):
        n = all_lens[:, j].tolist()
        out.append([None if n[r] < 0 else allv[r, at : at + n[r]].tolist() for r in range(seq.world_size)])
        at += w
    return out


def _first_difference(listed: Listed, lists: list[list[int] | None]) -> str:
    """``; first differing entry NAME[i]: per rank [...]`` of every rank's list (``-``: the
    list ends before entry ``i``), or the lists themselves when some rank has none."""
    if any(v is None for v in lists):
        return f"; {listed.name} per rank {[v if v is None or len(v) <= 8 else f'{len(v)} entries' for v in lists]}"
    longest = max(len(v) for v in lists)
    i = next((i for i in range(longest) if len({v[i] if i < len(v) else None for v in lists}) > 1), None)
    if i is None:  # same entries, the digest differs: cannot happen for lists of ints
        return ""
    at = listed.label(lists[0], i) if listed.label is not None else f"{listed.name}[{i}]"
    text = f"; first differing entry {at}: per rank {[v[i] if i < len(v) else '-' for v in lists]}"
    if len({len(v) for v in lists}) > 1:
        text += f" (lengths per rank {[len(v) for v in lists]})"
    return text


def _describe_disagreement(entry, col: list[int], detail: str = "") -> str:
    names = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else None  # code -> value, for the message
    shown = [names.get(v, v) for v in col] if names else col
    counts = {v: col.count(v) for v in col}
    reference = max(col, key=lambda v: (counts[v], -col.index(v)))  # the most common; ties: lowest rank's
    odd = [r for r, v in enumerate(col) if v != reference]
    which = f"rank {odd[0]} differs" if len(odd) == 1 else f"ranks {', '.join(map(str, odd))} differ"
    return f"{entry[0]}: per rank {shown} ({which}){detail}"


#: dtypes and device types as codes of the agreement (-1: not a tensor, -2: another one)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)
_DTYPE_NAMES = {-1: "not a tensor", -2: "another dtype", **{i: str(d).replace("torch.", "") for i, d in enumerate(_DTYPES)}}
_DEVICE_TYPES = ("cpu", "cuda", "meta")
_DEVICE_NAMES = {-1: "not a tensor", -2: "another device type", **dict(enumerate(_DEVICE_TYPES))}


def tensor_codes(tensors: dict) -> list[tuple]:
    """Agreement entries (:func:`sp_kpool.comm.agree_or_raise`) for the dtype and device
    type of every tensor of ``tensors`` (``{name: tensor or anything}``): ranks that differ
    in them would exchange buffers of other sizes (gloo aborts the process, NCCL may hang)."""
    sig = []
    for name, t in tensors.items():
        is_t = isinstance(t, torch.Tensor)
        dtype = (_DTYPES.index(t.dtype) if t.dtype in _DTYPES else -2) if is_t else -1
        dev = (_DEVICE_TYPES.index(t.device.type) if t.device.type in _DEVICE_TYPES else -2) if is_t else -1
        sig += [(f"{name}.dtype", dtype, _DTYPE_NAMES), (f"{name}.device type", dev, _DEVICE_NAMES)]
    return sig


def agree_or_raise(
    seq,
    local_error: BaseException | str | None,
    signature: Sequence[tuple],
    *,
    stats: CommStats | None = None,
    timeout: float | None = None,
    log_interval: float | None = None,
) -> None:
    """Fail on every rank alike if any rank saw bad input or ranks disagree.

    ``seq``: the ``ShardedSequence`` (or anything with its ``group``, ``rank`` and
    ``world_size``; the pipeline passes the process group's own). Every rank contributes
    its error (``local_error``: the exception of its checks, or its text) and a
    ``signature`` of named integers that must be equal everywhere (shapes, options, a hash
    of ``cu_seq_lens``): ``(name, value)`` or ``(name, code, {code: value})``, whose
    message shows the values, or ``(name, digest, Listed(...))``, whose message also names
    the first entry of the list that differs and each rank's value there (:class:`Listed`). One small all-gather carries them; only when a rank failed,
    a second one carries the error texts.

    Then every rank raises the same exception with the same message: the type of the
    error of the lowest failing rank (``ValueError``, ``TypeError``, else
    ``RuntimeError``) naming the failing ranks and their errors; or a ``ValueError`` naming
    each disagreeing entry, its value on every rank and the ranks that differ. The failing
    rank's own exception is chained as the cause. Both collectives wait at most
    ``timeout`` seconds (default :data:`~sp_kpool.settings.DEFAULT_COMM_TIMEOUT`;
    :func:`wait_or_raise`). A rank that waits logs after ``log_interval`` seconds
    (default :data:`~sp_kpool.settings.DEFAULT_COMM_LOG_INTERVAL`), and every as many
    seconds after, which ranks have not arrived (on gloo). With world size 1 this raises
    ``local_error`` itself (no communication).
    """
    code = _error_code(local_error)
    if seq.world_size == 1:
        if isinstance(local_error, BaseException):
            raise local_error
        if local_error is not None:
            raise ValueError(local_error)
        return
    timeout = DEFAULT_COMM_TIMEOUT if timeout is None else timeout
    dev = comm_device(seq)
    text = b"" if local_error is None else str(local_error).encode()
    vec = torch.tensor([code, len(text)] + [int(e[1]) for e in signature], dtype=torch.int64, device=dev)
    log_interval = DEFAULT_COMM_LOG_INTERVAL if log_interval is None else log_interval
    allv = _all_gather_timed(vec, seq, timeout, "agreement", log_interval).cpu()  # [world, 2 + n]
    if stats is not None:
        moved = (seq.world_size - 1) * _nbytes(vec)
        stats.add("validate", moved, moved)
    failed = [r for r in range(seq.world_size) if int(allv[r, 0])]
    cause = local_error if isinstance(local_error, BaseException) else None
    if failed:
        width = max(1, int(allv[:, 1].max()))
        buf = torch.zeros(width, dtype=torch.uint8)
        if text:
            buf[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        texts = _all_gather_timed(buf.to(dev), seq, timeout, "agreement (error texts)").cpu()
        lines = []
        for r in failed:
            kind = _ERROR_TYPES[int(allv[r, 0]) - 1].__name__
            message = bytes(texts[r, : int(allv[r, 1])].tolist()).decode(errors="replace")
            lines.append(f"rank {r}: {kind}: {message}")
        error_type = _ERROR_TYPES[int(allv[failed[0], 0]) - 1]
        where = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {', '.join(map(str, failed))}"
        raise error_type(f"invalid input on {where} of {seq.world_size}:\n  " + "\n  ".join(lines)) from cause
    differ = [(i, entry) for i, entry in enumerate(signature, start=2) if len(set(allv[:, i].tolist())) > 1]
    # every rank has the same allv, so the same entries differ: the lists behind the digests
    # that differ move in one more gather, on every rank alike
    listed = [entry[2] for _, entry in differ if len(entry) > 2 and isinstance(entry[2], Listed)]
    lists = dict(zip(map(id, listed), _gather_listed(seq, listed, timeout))) if listed else {}
    mismatched = []
    for i, entry in differ:
        extra = entry[2] if len(entry) > 2 else None
        detail = _first_difference(extra, lists[id(extra)]) if id(extra) in lists else ""
        mismatched.append(_describe_disagreement(entry, allv[:, i].tolist(), detail))
    if mismatched:
        raise ValueError(
            "ranks disagree on values that must be equal on every rank:\n  " + "\n  ".join(mismatched)
        )
