"""Launch ``world_size`` ranks from a test or the CLI, and always clean them up.

Each rank is a fresh ``spawn`` process joined to a ``FileStore`` in a per-call temporary
directory (no TCP port, so it is safe under pytest-xdist). The harness has its own
deadline; when a rank fails, its traceback is raised here and every other rank is killed.
"""

from __future__ import annotations

import os
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable

import torch

__all__ = ["run_ranks"]


def _rank_main(
    rank: int, fn: Callable, world_size: int, store_path: str, backend: str, out_dir: str, args: tuple, pg_timeout: float
):
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    backend: str = "gloo",
    timeout: float = 120.0,
    pg_timeout: float = 30.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return results by rank.

    ``fn`` must be importable (module level). The default process group is initialized
    in each rank (``backend`` ``"gloo"`` or ``"nccl"``, collective timeout ``pg_timeout``
    seconds; with NCCL each rank is set to its own GPU). Raises the failing rank's error
    (``torch.multiprocessing.ProcessRaisedException``) or ``TimeoutError`` past ``timeout`` s.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="sp_kpool_ranks_") as tmp:
        store_path = os.path.join(tmp, "store")
        ctx = mp.start_processes(
            _rank_main,
            args=(fn, world_size, store_path, backend, tmp, args, pg_timeout),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"run_ranks: {world_size} ranks of {fn.__name__} still running after {timeout} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(5)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
