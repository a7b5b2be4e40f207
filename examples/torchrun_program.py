"""A program of your own under ``torchrun``: the process group, one sharded call, a check.

Run (after ``bash scripts/demo.sh``, which made ``.venv``)::

    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 examples/torchrun_program.py

(``torchrun`` with ``.venv``'s Python: when ``.venv`` reuses the system's torch, a bare
``torchrun`` is the system's script and runs the system Python, without ``sp_kpool``.)

``torchrun`` starts one process per rank and sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``; ``init_process_group`` reads them. Every rank builds the
same global inputs from one seed, takes its rows, calls ``kpool_topk`` and checks its rows
against a world-size-1 call; it prints ``PASS`` or ``FAIL`` (exit 1).

The process group is destroyed before the program ends (``finally:``). Left alive, gloo's
threads are torn down at interpreter exit and the process may end with SIGABRT
("terminate called without an active exception") after printing its result: 11 of 27
two-rank runs of a plain ``init_process_group`` + ``all_reduce`` program without it, 0 of 15
with it (torch 2.13, CPU; benchmarks/results/cpu-2core-torch2.13/clean_exits_44.md). On GPUs: ``init_process_group("nccl")`` after
``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))``, and the tensors on that device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import sp_kpool
from sp_kpool import ShardedSequence

DOCS = [37, 20, 50]  # document lengths of one packed sequence (107 tokens)
H, D, K, TOPK = 8, 16, 4, 16  # index heads, head dim, tokens per pool, tokens selected per query


def global_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """The whole sequence's per-token tensors, the same on every rank (one seed)."""
    g = torch.Generator().manual_seed(seed)
    S = sum(DOCS)
    return {"q": torch.randn(S, H, D, generator=g), "k": torch.randn(S, D, generator=g),
            "gates": torch.randn(S, D, generator=g), "head_weights": torch.randn(S, H, generator=g),
            "ape": torch.randn(K, D, generator=g)}  # fmt: skip


def main() -> int:
    dist.init_process_group("gloo")  # reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (set by torchrun)
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        cu_seq_lens = torch.tensor([0, *torch.tensor(DOCS).cumsum(0).tolist()])
        seq = ShardedSequence.from_group(cu_seq_lens, group=dist.group.WORLD)  # this rank's rows
        x = global_inputs()
        mine = {name: seq.local_rows(t) for name, t in x.items() if name != "ape"}  # [S_local, ...]
        ids = sp_kpool.kpool_topk(**mine, ape=x["ape"], seq=seq, topk=TOPK, kpool=K)
        every = seq.global_rows(seq.real_ids(ids))  # collective: every rank's real rows, world-size-1 order
        one = ShardedSequence.split(cu_seq_lens, world_size=1, rank=0)
        want = sp_kpool.kpool_topk(**x, seq=one, topk=TOPK, kpool=K)
        ok = torch.equal(every, want)
        print(f"rank {rank}/{world_size}: {seq.shard_size} rows, ids {list(ids.shape)}: {'PASS' if ok else 'FAIL'}",
              flush=True)  # fmt: skip
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()  # before the interpreter exits (see the module docstring)


if __name__ == "__main__":
    raise SystemExit(main())
