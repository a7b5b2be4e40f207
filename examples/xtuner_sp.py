"""XTuner sequence parallelism: swap XTuner's ``kpool_topk_indices`` for ours.

Spawns ``--world-size`` ranks (CPU gloo by default; ``--device cuda``: NCCL, one GPU per rank),
builds on every rank what XTuner's ``SequenceContext.split(mesh)`` gives (global
``cu_seq_lens_q`` with the padding document, ``shard_start``, the sequence-parallel
``DeviceMesh``), calls :func:`sp_kpool.integrations.xtuner.kpool_topk_indices` with XTuner's
shapes on the local rows, and checks every rank's ids against a world-size-1 call on the whole
sequence. Prints ``PASS`` or ``FAIL`` per rank and overall; exits non-zero on failure.

XTuner is not needed: a stand-in ``SequenceContext`` with XTuner's field names is used (the
adapter reads attributes only). In XTuner itself the call is the one
``KPoolIndexer.forward`` makes::

    from sp_kpool.integrations.xtuner import kpool_topk_indices
    topk_ids = kpool_topk_indices(q, k, gate_scores, weights, kpool_ape, seq_ctx,
                                  index_head_dim=..., index_topk=..., index_kpool=...,
                                  always_select_tail=..., alignment=..., query_chunk_size=...)

``--replay``: the RL variant. Every rank turns the world-size-1 ids into what a rollout engine
returns per request (request-local token positions, one array per document, without the
last token's row, which the engine never ran) and passes them as ``replay=``: the replayed
ids (the uncovered rows computed) must equal the computed ones bit for bit, on every rank.

``--train``: a training step of the indexer's KL loss. Every rank computes
:func:`sp_kpool.indexer_kl_loss` on its rows (XTuner's columns as the selection, a random
``TokenMass`` aligned with them, XTuner's padding document included) and checks its
gradients, the loss shares' sum and ``ape``'s summed gradient against world size 1's.

Run: ``python examples/xtuner_sp.py [--world-size 2..4] [--device cuda] [--replay | --train]``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from sp_kpool import ShardedSequence, replay
from sp_kpool.integrations.xtuner import kpool_topk_indices
from sp_kpool.testing.dist import device_flag, run_ranks

DOCS = [53, 7, 1, 75, 30]  # packed documents, odd lengths (the total is padded by the split)
H, D, K, TOPK, ALIGN = 8, 16, 4, 16, 64


class SequenceContext:
    """XTuner's fields, as ``SequenceContext.split`` leaves them."""

    def __init__(self, cu_seq_lens_q, rows, sequence_parallel_mesh=None, shard_start=0):
        self.cu_seq_lens_q = self.cu_seq_lens_k = cu_seq_lens_q
        self.input_ids = torch.zeros(1, rows, dtype=torch.long)
        self.sequence_parallel_mesh = sequence_parallel_mesh
        self.shard_start, self.shard_size = shard_start, rows


def split_like_xtuner(docs, world_size):
    cu = [0]
    for n in docs:
        cu.append(cu[-1] + n)
    padded = -(-cu[-1] // world_size) * world_size
    if padded > cu[-1]:
        cu.append(padded)  # XTuner appends its padding as a document
    return torch.tensor(cu, dtype=torch.int32), padded // world_size


def rollout_capture(whole, cu):
    """What the rollout engine returns for each document: request-local positions of every
    row but the last (one array per document of ``cu``, XTuner's padding document included)."""
    docs = replay.documents(whole[:, 0], ShardedSequence.split(cu.cpu(), 1, 0))
    return [d[: max(0, d.shape[0] - 1)] for d in docs]


def rank_main(rank, world_size, device, inject_fault, replayed=False, train=False):
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dev = torch.device(f"cuda:{torch.cuda.current_device()}" if device == "cuda" else "cpu")
    mesh = init_device_mesh(device, (world_size,))
    cu, local = split_like_xtuner(DOCS, world_size)
    total = int(cu[-1])
    g = torch.Generator().manual_seed(0)  # every rank draws the same whole sequence
    q = torch.randn(1, total, H, D, generator=g).to(dev, torch.bfloat16)
    k = torch.randn(1, total, D, generator=g).to(dev, torch.bfloat16)
    gates = torch.randn(1, total, D, generator=g).to(dev, torch.bfloat16)
    weights = torch.randn(1, total, H, generator=g).to(dev)
    ape = torch.randn(K, D, generator=g).to(dev, torch.bfloat16)
    kw = dict(index_head_dim=D, index_topk=TOPK, index_kpool=K, always_select_tail=True, alignment=ALIGN)

    sl = slice(rank * local, (rank + 1) * local)
    ctx = SequenceContext(cu.to(dev), local, mesh, shard_start=rank * local)
    whole = kpool_topk_indices(q, k, gates, weights, ape, SequenceContext(cu.to(dev), total), **kw)
    if replayed:  # the rollout's selection replayed on the local rows (uncovered rows computed)
        kw["replay"] = rollout_capture(whole, cu)
    ids = kpool_topk_indices(q[:, sl], k[:, sl], gates[:, sl], weights[:, sl], ape, ctx, **kw)
    if train:  # the indexer's KL loss on XTuner's columns, against world size 1's
        from sp_kpool.integrations.xtuner import from_sequence_context
        from sp_kpool.testing.training_checks import stream_training_check

        stream = dict(q=q[0], k=k[0], gates=gates[0], head_weights=weights[0], ape=ape)
        ok = stream_training_check(from_sequence_context(ctx), from_sequence_context(SequenceContext(cu.to(dev), total)),
                                   stream, ids[:, 0], whole[:, 0], topk=TOPK, kpool=K, alignment=ALIGN,
                                   fault=inject_fault and rank == world_size - 1)  # fmt: skip
        return ok, list(ids.shape)
    if inject_fault and rank == world_size - 1:
        ids = ids.clone()
        ids[0, 0, 0] += 1
    expected_shape = [local, 1, -(-(TOPK + K - 1) // ALIGN) * ALIGN]
    ok = list(ids.shape) == expected_shape and ids.dtype == torch.int32 and torch.equal(ids.cpu(), whole[sl].cpu())
    return ok, list(ids.shape)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--device", type=device_flag(), default="cpu", help="cpu or cuda (NCCL, one GPU per rank)")
    ap.add_argument("--inject-fault", action="store_true", help="corrupt one id (the self-check must FAIL)")
    ap.add_argument("--replay", action="store_true", help="replay the rollout's selection instead of computing it")
    ap.add_argument("--train", action="store_true", help="a training step of the indexer's KL loss, vs world size 1")
    args = ap.parse_args(argv)
    backend = "nccl" if args.device == "cuda" else "gloo"
    results = run_ranks(rank_main, args.world_size, (args.device, args.inject_fault, args.replay, args.train),
                        backend=backend, timeout=300)  # fmt: skip
    what = "loss and gradients" if args.train else "ids"
    for rank, (ok, shape) in enumerate(results):
        print(f"rank {rank}: {what} {shape} {'PASS' if ok else 'FAIL'} (vs world size 1)")
    ok = all(r[0] for r in results)
    name = "xtuner_sp --replay" if args.replay else "xtuner_sp --train" if args.train else "xtuner_sp"
    print(f"{name} world_size={args.world_size} device={args.device}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
