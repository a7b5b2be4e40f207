"""Launch ``world_size`` ranks from a test or the CLI, and always clean them up.

Each rank is a fresh ``spawn`` process joined to a ``FileStore`` in a per-call temporary
directory (no TCP port, so it is safe under pytest-xdist). The harness has its own
deadline. When a rank fails (raises, or exits with a non-zero code, e.g. killed), the
others get ``grace`` seconds to end by themselves (their own errors are reported too),
then every rank still running is killed, and :class:`RanksFailed` says which rank failed
first, how, and what became of every other rank.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch

from .._device import device_flag  # the examples' --device flag

__all__ = ["run_ranks", "RanksFailed", "RanksTimedOut", "device_flag"]


class RanksFailed(RuntimeError):
    """A rank of :func:`run_ranks` failed.

    Attributes: ``failed`` (the ranks that raised or exited non-zero, in the order seen,
    the first one first), ``statuses`` (``{rank: text}``: ``"returned"``, ``"raised"``,
    ``"exited with code N"``, ``"killed: ..."``), ``errors`` (``{rank: traceback text}`` of
    the ranks that raised) and ``results`` (``{rank: result}`` of the ranks that returned).
    """

    def __init__(self, message: str, failed, statuses, errors, results):
        super().__init__(message)
        self.failed, self.statuses, self.errors, self.results = list(failed), statuses, errors, results

    @property
    def rank(self) -> int | None:
        """The first rank that failed (``None``: none failed, some were still running)."""
        return self.failed[0] if self.failed else None


class RanksTimedOut(RanksFailed, TimeoutError):
    """:func:`run_ranks` passed its deadline with ranks still running (they were killed)."""


def _rank_main(
    rank: int, fn: Callable, world_size: int, store_path: str, backend: str, out_dir: str, args: tuple, pg_timeout: float
):
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()  # a rank that aborts (a C++ terminate, a signal) prints its Python stacks
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout))  # fmt: skip
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1) from None
    # The result is saved and the process group destroyed: leave without the interpreter's
    # teardown. On a loaded machine gloo's static teardown sometimes ends a finished rank in
    # a C++ terminate (SIGABRT, "terminate called without an active exception", no Python
    # frame: 3 times in about 60 multi-rank runs on a loaded 2-core VM, torch 2.14), which
    # would report a rank that returned as failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    backend: str = "gloo",
    timeout: float = 120.0,
    pg_timeout: float = 30.0,
    grace: float = 5.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return results by rank.

    ``fn`` must be importable (module level) and its result picklable. The default process
    group is initialized in each rank (``backend`` ``"gloo"`` or ``"nccl"``, collective
    timeout ``pg_timeout`` seconds; with NCCL each rank is set to its own GPU).

    Raises :class:`RanksFailed` when a rank raises or exits non-zero (naming the first one,
    with its traceback; the others get ``grace`` seconds to end, then are killed), or
    :class:`RanksTimedOut` (a ``TimeoutError``) when ranks still run after ``timeout``
    seconds (they are killed). No rank process outlives this call.
    """
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend: 'nccl' needs CUDA GPUs, and CUDA is not available on this host "
                         "(torch.cuda.is_available() is False): use 'gloo'")  # fmt: skip
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="sp_kpool_ranks_") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank_main, args=(r, fn, world_size, store_path, backend, tmp, args, pg_timeout),
                        name=f"sp_kpool-rank{r}")  # fmt: skip
            for r in range(world_size)
        ]
        failed: list[int] = []
        killed: dict[int, str] = {}
        first_failure = None
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            while True:
                now = time.monotonic()
                for r, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and r not in failed:
                        failed.append(r)
                        first_failure = first_failure or now
                running = [r for r, p in enumerate(procs) if p.exitcode is None]
                if not running:
                    break
                if first_failure is not None and now > first_failure + grace:
                    killed = {r: f"killed: still running {grace:g} s after rank {failed[0]} failed" for r in running}
                    break
                if now > deadline:
                    killed = {r: f"killed: still running after the {timeout:g} s deadline" for r in running}
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(10)
        statuses, errors, results = {}, {}, {}
        for r, p in enumerate(procs):
            err = os.path.join(tmp, f"rank{r}.err")
            out = os.path.join(tmp, f"rank{r}.pt")
            if r in killed:
                statuses[r] = killed[r]
            elif os.path.exists(err):
                statuses[r] = "raised"
                with open(err) as f:
                    errors[r] = f.read()
            elif p.exitcode == 0 and os.path.exists(out):
                statuses[r] = "returned"
                results[r] = torch.load(out, weights_only=False)
            else:
                statuses[r] = f"exited with code {p.exitcode}"
        if failed or killed:
            summary = "; ".join(f"rank {r}: {statuses[r]}" for r in range(world_size))
            if failed:
                first = failed[0]
                head = f"run_ranks: rank {first} of {world_size} ranks of {fn.__name__} failed ({statuses[first]})"
                detail = f"\n--- rank {first}:\n{errors[first]}" if first in errors else ""
                raise RanksFailed(f"{head}\n{summary}{detail}", failed, statuses, errors, results)
            raise RanksTimedOut(f"run_ranks: {world_size} ranks of {fn.__name__} still running after {timeout} s\n"
                                f"{summary}", failed, statuses, errors, results)  # fmt: skip
        return [results[r] for r in range(world_size)]
