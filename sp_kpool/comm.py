"""Collectives over the ``ShardedSequence`` process group.

Only two things cross ranks in the gather-keys path: the keys and gates (all-gathered
before pooling, because a pool may straddle rows of two ranks) and a tiny validation vector
(so that bad input fails on every rank alike, before any data collective, never hangs).
The gather-pools path (:mod:`sp_kpool.pool_gather`) and the causal balance
(:mod:`sp_kpool.balance`) add point-to-point row exchanges (:func:`exchange_rows`) and an
all-gather of unequal row counts (:func:`all_gather_uneven_rows`).

Every collective here takes an optional :class:`CommStats` and adds to it the bytes this
rank actually handed to and received from the other ranks, under a tag: counted from the
tensors the collective moves (padding included), not estimated.

In the contiguous layout shards are equal by construction (``ShardedSequence`` pads), so
the keys go through one even, concatenated (dim-0) all-gather, on gloo and NCCL alike; in
the other layouts (:mod:`sp_kpool.layouts`) counts may differ, and :func:`gather_keys` pads
to the largest count, gathers once and puts the rows in real-row order. The process group
is always passed in explicitly; nothing is kept in module globals except the resolved
gather function.

One cohesive concept over 500 lines, so one module: every collective over the sequence's
group, sharing the byte counting, the timed waits and the agreement that reports a bad
input on every rank alike.
"""

from __future__ import annotations

import functools
import logging
import time
import zlib
from datetime import timedelta
from typing import Sequence

import torch

from ._device import to_device
from .settings import DEFAULT_COMM_LOG_INTERVAL, DEFAULT_COMM_TIMEOUT, ENV, current_settings
from .sharding import ShardedSequence, register_collectives

TIMEOUT_VARIABLE = ENV["comm_timeout"]
LOG_INTERVAL_VARIABLE = ENV["comm_log_interval"]
logger = logging.getLogger("sp_kpool")

__all__ = [
    "CommStats",
    "Listed",
    "comm_device",
    "all_gather_rows",
    "all_gather_uneven_rows",
    "exchange_rows",
    "pack_rows",
    "unpack_rows",
    "agree_or_raise",
    "tensor_codes",
    "gather_positions",
    "global_rows",
    "gather_keys",
    "real_order",
    "take_rows",
    "wait_or_raise",
]


class CommStats:
    """Bytes this rank sent to and received from other ranks, per tag, and the calls.

    Updated by the collectives of this module. For an all-gather of ``R`` chunks of ``b``
    bytes a rank sends its chunk to ``R - 1`` ranks and receives ``R - 1`` chunks:
    ``sent = received = (R - 1) * b`` (also what a ring all-gather puts on each link).
    For point-to-point exchanges, the bytes of the tensors sent and received. Data that a
    rank keeps for itself is never counted.
    """

    def __init__(self) -> None:
        self.by_tag: dict[str, dict[str, int]] = {}

    def add(self, tag: str, sent: int, received: int) -> None:
        entry = self.by_tag.setdefault(tag, {"sent": 0, "received": 0, "calls": 0})
        entry["sent"] += int(sent)
        entry["received"] += int(received)
        entry["calls"] += 1

    @property
    def sent(self) -> int:
        return sum(e["sent"] for e in self.by_tag.values())

    @property
    def received(self) -> int:
        return sum(e["received"] for e in self.by_tag.values())

    def as_dict(self) -> dict:
        """``{"sent": int, "received": int, "by_tag": {tag: {"sent", "received", "calls"}}}``."""
        return {
            "sent": self.sent,
            "received": self.received,
            "by_tag": {t: dict(e) for t, e in self.by_tag.items()},
        }


@functools.lru_cache(maxsize=1)
def _gather_into_tensor():
    """``dist.all_gather_single`` (torch >= 2.13) or ``all_gather_into_tensor`` (older)."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None)
    return fn if fn is not None else dist.all_gather_into_tensor


def comm_device(seq: ShardedSequence) -> torch.device:
    """Device that the group's backend communicates on: CUDA for NCCL, else CPU."""
    return _group_device(seq.group)


def _group_device(group) -> torch.device:
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _finish(works, seq: ShardedSequence, timeout: float | None, what: str) -> None:
    """Wait for the async collectives ``works``: on gloo at most ``timeout`` seconds each
    (:func:`wait_or_raise`; ``None``: the process group's own timeout). On NCCL the host
    does not wait (the device stream does): a hung peer is caught by the process group's
    timeout (its watchdog), so the host keeps running ahead of the device."""
    import torch.distributed as dist

    nccl = "nccl" in str(dist.get_backend(seq.group)).lower()
    for work in works:
        if timeout is None or nccl:
            work.wait()
        else:
            wait_or_raise(work, timeout, what)


def all_gather_rows(
    x: torch.Tensor, seq: ShardedSequence, *, stats: CommStats | None = None, tag: str = "all_gather",
    timeout: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """All-gather equal row shards: ``x_shard [S / R, *F]`` -> ``x [S, *F]`` (rank order).

    With world size 1 the input is returned as is. The result is on ``x.device``.
    ``timeout``: seconds to wait on gloo (see :func:`_finish`).
    """
    if seq.world_size == 1:
        return x
    dev = comm_device(seq)
    src = x.contiguous().to(dev)
    out = torch.empty((seq.world_size * src.shape[0], *src.shape[1:]), dtype=src.dtype, device=dev)
    _finish([_gather_into_tensor()(out, src, group=seq.group, async_op=True)], seq, timeout, f"all-gather ({tag})")
    if stats is not None:
        moved = (seq.world_size - 1) * _nbytes(src)
        stats.add(tag, moved, moved)
    return out.to(x.device)


def take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` (int64 CPU) of ``x``: a view when they are a contiguous ascending
    range (the contiguous layout), else one ``index_select``."""
    n = index.numel()
    if n == 0:
        return x[:0]
    a = int(index[0])
    if int(index[-1]) - a + 1 == n and torch.equal(index, torch.arange(a, a + n)):
        return x[a : a + n]
    return x.index_select(0, to_device(index, x.device))


def gather_keys(x: torch.Tensor, seq: ShardedSequence, stats: CommStats | None = None,
                timeout: float | None = None) -> torch.Tensor:  # fmt: skip
    """Every rank's rows of ``x [S_local, *F]`` in real-row order: ``[N, *F]`` (``N`` real
    rows; in the contiguous layout ``[S, *F]``, the padding rows last). One all-gather
    (of rows padded to the largest rank's count when counts differ), then, unless the
    layout is contiguous, one ``index_select`` into real-row order."""
    if seq.is_contiguous:
        return all_gather_rows(x, seq, stats=stats, tag="gather_keys", timeout=timeout)
    counts = [p.numel() for p in seq.rank_positions]
    return real_order(all_gather_uneven_rows(x, counts, seq, stats=stats, tag="gather_keys", timeout=timeout), seq)


def real_order(full: torch.Tensor, seq: ShardedSequence) -> torch.Tensor:
    """The concatenation of every rank's rows (rank order, each in storage order) in
    real-row order (``[N, *F]``; the contiguous layout's concatenation already is, and is
    returned as is)."""
    if seq.is_contiguous:
        return full
    return full.index_select(0, to_device(seq.gathered_index, full.device))


def all_gather_uneven_rows(
    x: torch.Tensor,
    counts: Sequence[int],
    seq: ShardedSequence,
    *,
    stats: CommStats | None = None,
    tag: str = "all_gather_uneven",
    timeout: float | None = None,
) -> torch.Tensor:
    """All-gather row blocks of known, unequal sizes: ``x [counts[rank], *F]`` ->
    ``[sum(counts), *F]`` in rank order.

    ``counts`` (one per rank) must be known on every rank (no size exchange happens here).
    Portable on gloo and NCCL: pad every block to ``max(counts)`` rows, one even
    all-gather, slice. The padding is moved (and counted). With world size 1, ``x``.
    """
    if len(counts) != seq.world_size or int(counts[seq.rank]) != x.shape[0]:
        raise ValueError(
            f"counts: expected {seq.world_size} entries with counts[{seq.rank}] = {x.shape[0]} "
            f"(rows of x), got {list(counts)}"
        )
    if seq.world_size == 1:
        return x
    width = max(int(c) for c in counts)
    if width == 0:
        return x.new_empty((0, *x.shape[1:]))
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[: x.shape[0]] = x
    full = all_gather_rows(padded, seq, stats=stats, tag=tag, timeout=timeout)
    return torch.cat([full[r * width : r * width + int(c)] for r, c in enumerate(counts)])


def exchange_rows(
    sends: dict[int, torch.Tensor],
    recvs: dict[int, tuple[int, ...]],
    seq: ShardedSequence,
    *,
    dtype: torch.dtype,
    device: torch.device,
    stats: CommStats | None = None,
    tag: str = "exchange",
    timeout: float | None = None,
) -> dict[int, torch.Tensor]:
    """Point-to-point exchange in one ``batch_isend_irecv``: returns ``{peer: tensor}``.

    ``sends``: ``{peer: tensor}`` to send (peers are ranks of ``seq.group``, never this
    rank; empty tensors are skipped); ``recvs``: ``{peer: shape}`` to receive, of
    ``dtype``, returned on ``device``. Both sides must agree on every shape (callers derive
    them from the same global layout). Ranks without any transfer do not call anything.
    """
    import torch.distributed as dist

    out: dict[int, torch.Tensor] = {}
    ops = []
    dev = comm_device(seq) if seq.world_size > 1 else device

    def global_rank(peer: int) -> int:
        return peer if seq.group is None else dist.get_global_rank(seq.group, peer)

    sent = received = 0
    for peer, shape in sorted(recvs.items()):
        if peer == seq.rank:
            raise ValueError(f"recvs: a rank cannot receive from itself (rank {peer})")
        buf = torch.empty(shape, dtype=dtype, device=dev)
        out[peer] = buf
        if buf.numel():
            ops.append(dist.P2POp(dist.irecv, buf, global_rank(peer), seq.group))
            received += _nbytes(buf)
    for peer, x in sorted(sends.items()):
        if peer == seq.rank:
            raise ValueError(f"sends: a rank cannot send to itself (rank {peer})")
        if x.numel():
            src = x.contiguous().to(dev)
            ops.append(dist.P2POp(dist.isend, src, global_rank(peer), seq.group))
            sent += _nbytes(src)
    if ops:
        _finish(dist.batch_isend_irecv(ops), seq, timeout, f"point-to-point exchange ({tag})")
    if stats is not None and (sent or received):
        stats.add(tag, sent, received)
    return {peer: buf.to(device) for peer, buf in out.items()}


def pack_rows(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[torch.dtype, tuple[int, ...]]]]:
    """Concatenate tensors with the same leading dim ``n`` into one ``uint8 [n, B]`` buffer.

    Each row holds the bytes of that row of every tensor, in order, so a row range of the
    buffer is the same row range of every tensor (any dtype: FP8 included, which gloo
    cannot reduce but can move as bytes). Returns the buffer and the layout for
    :func:`unpack_rows`.
    """
    n = tensors[0].shape[0]
    parts, layout = [], []
    for t in tensors:
        if t.shape[0] != n:
            raise ValueError(f"pack_rows: expected leading dim {n} for every tensor, got {t.shape[0]}")
        layout.append((t.dtype, tuple(t.shape[1:])))
        per_row = torch.Size(t.shape[1:]).numel()
        parts.append(t.contiguous().reshape(n, per_row).view(torch.uint8))
    return torch.cat(parts, dim=1), layout


def unpack_rows(buf: torch.Tensor, layout: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """Inverse of :func:`pack_rows` for ``buf [m, B]`` (any row count ``m``)."""
    out, col = [], 0
    m = buf.shape[0]
    for dtype, tail in layout:
        per_row = torch.Size(tail).numel() * torch.empty((), dtype=dtype).element_size()
        if m == 0:
            out.append(torch.empty((0, *tail), dtype=dtype, device=buf.device))
        else:
            chunk = buf[:, col : col + per_row].contiguous()
            if chunk.storage_offset() % torch.empty((), dtype=dtype).element_size():
                chunk = chunk.clone()  # a view as a wider dtype needs an aligned start
            out.append(chunk.view(dtype).reshape(m, *tail))
        col += per_row
    if col != buf.shape[1]:
        raise ValueError(f"unpack_rows: layout covers {col} bytes per row, buffer has {buf.shape[1]}")
    return out


#: Exception types the agreement carries from a rank to every rank (code: index + 1; 0:
#: no error). Any other exception of a rank's checks travels as ``RuntimeError``.
_ERROR_TYPES = (ValueError, TypeError, RuntimeError)


def _error_code(error) -> int:
    if error is None:
        return 0
    if isinstance(error, str):
        return 1
    return next((i + 1 for i, t in enumerate(_ERROR_TYPES) if isinstance(error, t)), len(_ERROR_TYPES))


def wait_or_raise(work, timeout: float, what: str) -> None:
    """Wait for the collective ``work`` (``async_op=True``) at most ``timeout`` seconds.

    Raises ``TimeoutError`` when it has not completed by then (a rank died, stopped
    answering or did not make the call), ``RuntimeError`` when the backend failed earlier
    (gloo: a peer closed its connection); both name ``what``. After either the process
    group is not safe to use again (collectives may be left half done): end the job.
    """
    t0 = time.monotonic()
    try:
        work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as exc:
        waited = time.monotonic() - t0
        if waited >= 0.99 * timeout:
            raise TimeoutError(
                f"{what}: not every rank answered within {timeout:g} s ({TIMEOUT_VARIABLE}): a rank died, "
                f"stopped answering or did not make this call"
            ) from exc
        # the backend's text (addresses, ports) differs between ranks: it is the cause, not the message
        raise RuntimeError(f"{what}: the collective failed before the {timeout:g} s timeout ({TIMEOUT_VARIABLE}): a "
                           f"rank died or closed its connection (the cause is the backend's error)") from exc  # fmt: skip


class _Arrivals:
    """Which ranks reached the agreement, told through the process group's store, only
    once a wait has lasted :data:`_ANNOUNCE_AFTER` seconds (a prompt agreement never
    touches the store). Each rank counts its agreements per group (call ``n``); a rank
    that waits writes the key of ``(group, n, rank)``; the ranks without a key have not
    arrived (or arrived less than a second ago)."""

    _calls: dict = {}

    def __init__(self, seq) -> None:
        import torch.distributed as dist

        self.seq, self.store, self.keys = seq, None, []
        try:
            pg = dist.group.WORLD if seq.group is None else seq.group
            from torch.distributed import distributed_c10d as c10d

            self.store = c10d._get_process_group_store(pg)
            name = getattr(pg, "group_name", "") or "world"
        except Exception:  # noqa: BLE001 - no store: the log says the ranks are unknown
            name = "world"
        key = (name, seq.world_size)
        self.call = _Arrivals._calls[key] = _Arrivals._calls.get(key, 0) + 1
        self.prefix = f"sp_kpool/agreement/{name}/{self.call}/"

    def announce(self) -> None:
        if self.store is not None:
            try:
                self.store.set(self.prefix + str(self.seq.rank), "1")
                self.keys.append(self.prefix + str(self.seq.rank))
            except Exception:  # noqa: BLE001
                self.store = None

    def missing(self) -> list[int] | None:
        """The ranks that have not announced (``None``: unknown)."""
        if self.store is None:
            return None
        try:
            return [r for r in range(self.seq.world_size) if not self.store.check([self.prefix + str(r)])]
        except Exception:  # noqa: BLE001
            return None

    def done(self) -> None:
        for k in self.keys:
            try:
                self.store.delete_key(k)
            except Exception:  # noqa: BLE001
                pass


#: Seconds an agreement waits before the rank announces its arrival in the store.
_ANNOUNCE_AFTER = 1.0


def _wait_explained(work, seq, timeout: float, what: str, log_interval: float) -> None:
    """:func:`wait_or_raise`, logging (a warning of the ``sp_kpool`` logger) after
    ``log_interval`` seconds, and every ``log_interval`` seconds after that, which ranks
    have not arrived. The timeout is unchanged. On gloo the wait is cut into slices; NCCL
    waits in one piece, as before (a cut NCCL wait may abort the communicator)."""
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend(seq.group)).lower():
        wait_or_raise(work, timeout, what)
        return
    arrivals = _Arrivals(seq)
    t0 = time.monotonic()
    marks = [min(_ANNOUNCE_AFTER, log_interval)]  # seconds since t0 at which to wake
    next_log = log_interval
    try:
        while True:
            until = min(marks[0] if marks else next_log, next_log, timeout)
            try:
                work.wait(timeout=timedelta(seconds=max(until - (time.monotonic() - t0), 1e-3)))
                return
            except RuntimeError as exc:
                waited = time.monotonic() - t0
                if waited >= 0.99 * timeout:
                    raise TimeoutError(
                        f"{what}: not every rank answered within {timeout:g} s ({TIMEOUT_VARIABLE}): a rank died, "
                        f"stopped answering or did not make this call"
                    ) from exc
                if waited < 0.99 * until:
                    raise RuntimeError(f"{what}: the collective failed before the {timeout:g} s timeout "
                                       f"({TIMEOUT_VARIABLE}): a rank died or closed its connection (the cause "
                                       f"is the backend's error)") from exc  # fmt: skip
            if marks and waited >= 0.99 * marks[0]:
                marks.pop(0)
                arrivals.announce()
            if waited >= 0.99 * next_log:
                next_log += log_interval
                missing = arrivals.missing()
                who = ("ranks not known (no store)" if missing is None else
                       f"rank(s) {missing} of {seq.world_size} have not arrived")  # fmt: skip
                logger.warning(
                    "sp_kpool: rank %d of %d has waited %.0f s in the %s (call %d in this process group): %s; "
                    "it raises TimeoutError after %g s (%s; this message every %g s: %s)",
                    seq.rank, seq.world_size, waited, what, arrivals.call, who, timeout, TIMEOUT_VARIABLE,
                    log_interval, LOG_INTERVAL_VARIABLE,
                )  # fmt: skip
    finally:
        arrivals.done()


def _all_gather_timed(x: torch.Tensor, seq, timeout: float, what: str,
                      log_interval: float | None = None) -> torch.Tensor:  # fmt: skip
    """``[world, *x.shape]``: every rank's ``x``, in rank order, within ``timeout`` s
    (``log_interval``: log which ranks have not arrived, :func:`_wait_explained`)."""
    out = torch.empty((seq.world_size, *x.shape), dtype=x.dtype, device=x.device)
    work = _gather_into_tensor()(out, x[None].contiguous(), group=seq.group, async_op=True)
    if log_interval is None:
        wait_or_raise(work, timeout, what)
    else:
        _wait_explained(work, seq, timeout, what, log_interval)
    return out


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


def gather_positions(positions: torch.Tensor, error: str | None, *, world_size: int, rank: int, group=None
                     ) -> list[torch.Tensor]:  # fmt: skip
    """Every rank's ``positions`` (int64 CPU, sizes may differ), for
    :meth:`sp_kpool.ShardedSequence.from_positions`: one small all-gather of the sizes and
    error flags, then one of the positions (padded to the largest size). A rank's local
    ``error`` (or a world size / rank that does not match ``group``) makes every rank
    raise the same ``ValueError`` naming the rank(s), before the positions move."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"world_size: {world_size} ranks need an initialized torch.distributed process group")
    actual = (dist.get_world_size(group), dist.get_rank(group))
    if actual[0] != world_size:  # every rank of the group sees the same size: raised alike
        raise ValueError(f"world_size: expected dist.get_world_size(group) = {actual[0]}, got {world_size}")
    if error is None and actual[1] != rank:
        error = f"ValueError: rank: expected dist.get_rank(group) = {actual[1]}, got {rank}"
    dev = _group_device(group)
    head = torch.tensor([[1 if error else 0, positions.numel()]], dtype=torch.int64, device=dev)
    heads = torch.empty((world_size, 2), dtype=torch.int64, device=dev)
    timeout = current_settings().comm_timeout
    wait_or_raise(_gather_into_tensor()(heads, head, group=group, async_op=True), timeout, "from_positions")
    heads = heads.cpu()
    failed = [r for r in range(world_size) if int(heads[r, 0])]
    if failed:
        texts: list = [None] * world_size
        dist.all_gather_object(texts, error, group=group)
        raise ValueError("invalid input on rank(s) %s:\n  %s" % (failed, "\n  ".join(f"rank {r}: {texts[r]}" for r in failed)))
    counts = heads[:, 1].tolist()
    width = max(counts)
    buf = torch.full((width,), -1, dtype=torch.int64, device=dev)
    buf[: positions.numel()] = positions.to(dev)
    full = torch.empty((world_size * width,), dtype=torch.int64, device=dev)
    wait_or_raise(_gather_into_tensor()(full, buf, group=group, async_op=True), timeout, "from_positions")
    full = full.cpu()
    return [full[r * width : r * width + c].clone() for r, c in enumerate(counts)]


def global_rows(seq: ShardedSequence, rows: torch.Tensor, *, timeout: float | None = None) -> torch.Tensor:
    """:meth:`sp_kpool.ShardedSequence.global_rows` (documented there): every rank's rows
    back in real-token order, after an agreement on the rows' dtype, device type and
    trailing shape (local with world size 1 and no group)."""
    error = None
    if not isinstance(rows, torch.Tensor):
        error = TypeError(f"rows: expected a torch.Tensor [S_local, ...], got {type(rows).__name__}")
    elif rows.dim() < 1 or rows.shape[0] != seq.shard_size:
        error = ValueError(f"rows: expected shape [{seq.shard_size}, ...] (seq.shard_size of rank "
                           f"{seq.rank}/{seq.world_size}), got {list(rows.shape)}")  # fmt: skip
    ok = isinstance(rows, torch.Tensor) and rows.dim() >= 1
    trailing = zlib.crc32(repr(list(rows.shape[1:])).encode()) if ok else -1
    shape = Listed("rows.shape[1:]", list(rows.shape[1:]) if ok else None)
    signature = tensor_codes({"rows": rows}) + [("rows.shape[1:] (crc32)", trailing, shape)]
    if timeout is None:
        timeout = current_settings().comm_timeout
    if seq.world_size == 1 and seq.group is None:
        if error is not None:
            raise error
    else:
        agree_or_raise(seq, error, signature, timeout=timeout)
    return gather_keys(rows, seq, timeout=timeout)[: seq.num_real_tokens]


# the sequence's two collectives live here, above it: given to it at this module's import
register_collectives(gather_positions=gather_positions, global_rows=global_rows)
