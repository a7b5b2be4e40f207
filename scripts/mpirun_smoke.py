"""mpirun smoke check: ranks and world size from MPI, a torch.distributed group, a small
odd-length packed run checked bit for bit against world size 1; one PASS/FAIL line per rank.

    mpirun -np 4 --oversubscribe python -m mpi4py scripts/mpirun_smoke.py
    (as root add --allow-run-as-root)

The rendezvous is a FileStore in a directory that rank 0 creates and broadcasts over MPI,
so no TCP port is needed. NCCL when CUDA is available (local rank from a shared-memory
MPI split), gloo otherwise. Exit status 1 on any rank's failure (python -m mpi4py turns an
uncaught exception into MPI_Abort, which ends every rank).

Runs with the package installed (``pip install -e .`` from the repository root).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from datetime import timedelta


def main() -> int:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from sp_kpool.testing.rank_checks import sharded_vs_world1

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    local_rank = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    tmp = comm.bcast(tempfile.mkdtemp(prefix="sp_kpool_mpi_") if rank == 0 else None, root=0)
    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    store = dist.FileStore(os.path.join(tmp, "store"), size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timedelta(seconds=60))
    try:
        rep = sharded_vs_world1(rank, size, [37, 1, 3, 64, 2, 46], 4, 16, seed=7, device=device, tail="compact")
    finally:
        dist.destroy_process_group()
    comm.Barrier()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    verdict = "PASS" if rep.equal else "FAIL"
    print(
        f"mpirun rank {rank}/{size} ({backend}, {device}): shard [{rep.shard[0]}, {rep.shard[1]}) "
        f"real rows {rep.real_rows} selected ids {rep.selected}: {verdict}",
        flush=True,
    )
    ok = comm.allreduce(1 if rep.equal else 0, op=MPI.MIN)
    return 0 if ok else 1


if __name__ == "__main__":
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__)
        sys.exit(0)
    sys.exit(main())
