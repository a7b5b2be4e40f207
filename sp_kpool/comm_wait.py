"""Waiting on a collective, and what every collective of :mod:`sp_kpool.comm` shares.

A collective here never hangs: on gloo the host waits at most the settings' ``comm_timeout``
(:func:`wait_or_raise`: ``TimeoutError`` when a rank died, stopped answering or did not make
the call; ``RuntimeError`` when the backend failed earlier), and an agreement that waits
logs which ranks have not arrived (:func:`_wait_explained`, through the process group's
store). On NCCL the device stream waits and the process group's watchdog catches a hung
peer. Shared by the gathers (:mod:`sp_kpool.comm`), the point-to-point exchange
(:mod:`sp_kpool.comm_exchange`) and the agreement (:mod:`sp_kpool.comm_agree`): the device
the group communicates on (:func:`comm_device`) and the byte counter (:class:`CommStats`).
"""

from __future__ import annotations

import functools
import logging
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from .settings import ENV

if TYPE_CHECKING:  # the collectives take the sequence; it sits below them
    from .sharding import ShardedSequence

TIMEOUT_VARIABLE = ENV["comm_timeout"]
LOG_INTERVAL_VARIABLE = ENV["comm_log_interval"]
logger = logging.getLogger("sp_kpool")

__all__ = ["CommStats", "comm_device", "wait_or_raise", "TIMEOUT_VARIABLE", "LOG_INTERVAL_VARIABLE"]


class CommStats:
    """Bytes this rank sent to and received from other ranks, per tag, and the calls.

    Updated by the collectives of :mod:`sp_kpool.comm` and its siblings. For an all-gather of ``R`` chunks of ``b``
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
        raise _wait_failed(time.monotonic() - t0, timeout, what) from exc


def _wait_failed(waited: float, timeout: float, what: str) -> Exception:
    """The error of a wait that the backend ended after ``waited`` seconds:
    ``TimeoutError`` once the ``timeout`` is spent, else ``RuntimeError`` (it failed
    earlier: a peer closed its connection); the backend's error is its cause."""
    if waited >= 0.99 * timeout:
        return TimeoutError(f"{what}: not every rank answered within {timeout:g} s ({TIMEOUT_VARIABLE}): a rank died, "
                            f"stopped answering or did not make this call")  # fmt: skip
    # the backend's text (addresses, ports) differs between ranks: it is the cause, not the message
    return RuntimeError(f"{what}: the collective failed before the {timeout:g} s timeout ({TIMEOUT_VARIABLE}): a "
                        f"rank died or closed its connection (the cause is the backend's error)")  # fmt: skip


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
                if waited >= 0.99 * timeout or waited < 0.99 * until:  # the timeout spent, or failed early
                    raise _wait_failed(waited, timeout, what) from exc
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
