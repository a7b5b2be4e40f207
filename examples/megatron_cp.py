"""Megatron-LM context parallelism: our KPool ids from ``PackedSeqParams`` and the CP group.

Spawns ``--world-size`` ranks (CPU gloo by default; ``--device cuda``: NCCL, one GPU per rank).
Every rank holds its zigzag THD rows of a packed batch whose sequences are padded to a
multiple of ``2 * cp_size`` (``cu_seqlens_q_padded``, as Megatron's data pipeline pads them),
builds the :class:`ShardedSequence` with
:func:`sp_kpool.integrations.megatron.sharded_sequence`, calls :func:`sp_kpool.kpool_topk` on
its local rows and checks (1) its ids against a world-size-1 call on the padded stream and
(2) that the ids index the K/V Megatron's ``DSAttention`` builds: every rank's local K
all-gathered in rank order, then ``index_select(0, kv_reorder_idx)``
(:func:`~sp_kpool.integrations.megatron.key_reorder`). Also the non-packed zigzag
(``packed_seq_params=None, seq_len=``). Prints ``PASS``/``FAIL``; exits non-zero on failure.

``--replay``: the RL variant. The world-size-1 ids become what a rollout engine returns per
request (request-local token positions of every real sequence, without the last token's
row); every rank replays them with :func:`~sp_kpool.integrations.megatron.replayed_ids` (the
uncovered rows computed) and checks them against the computed ids bit for bit and with
:func:`sp_kpool.replay.compare` (no row differs, totals over the ranks).

``--train``: a training step of the indexer's KL loss. Every rank computes
:func:`sp_kpool.indexer_kl_loss` on its THD rows (its ids as the selection, a random
``TokenMass`` aligned with them) and checks its gradients, the loss shares' sum and
``ape``'s summed gradient against world size 1's on the padded stream.

Megatron is not needed: ``PackedSeqParams``' fields are given in a ``SimpleNamespace`` (the
adapter reads attributes only). Run: ``python examples/megatron_cp.py [--world-size 2..4]
[--device cuda] [--replay | --train]``.
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import torch

from sp_kpool import kpool_topk, replay
from sp_kpool.integrations.megatron import key_reorder, replayed_ids, sharded_sequence
from sp_kpool.testing.dist import device_flag, run_ranks

SEQS = [37, 5, 64, 1, 22]  # real lengths of the packed sequences
H, D, K, TOPK = 8, 16, 4, 16


def packed_seq_params(lengths, cp_size):
    cu, cu_pad = [0], [0]
    for n in lengths:
        cu.append(cu[-1] + n)
        cu_pad.append(cu_pad[-1] + -(-n // (2 * cp_size)) * 2 * cp_size)
    cu, cu_pad = torch.tensor(cu, dtype=torch.int32), torch.tensor(cu_pad, dtype=torch.int32)
    return SimpleNamespace(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
                           cu_seqlens_kv_padded=cu_pad)  # fmt: skip


def check(seq, world1, dev, seed, fault, replayed=False, train=False):
    import torch.distributed as dist

    total = world1.total_length
    g = torch.Generator().manual_seed(seed)  # every rank draws the same stream-order tensors
    q = torch.randn(total, H, D, generator=g).to(dev, torch.bfloat16)
    k = torch.randn(total, D, generator=g).to(dev, torch.bfloat16)
    gates = torch.randn(total, D, generator=g).to(dev, torch.bfloat16)
    w = torch.randn(total, H, generator=g).to(dev)
    ape = torch.randn(K, D, generator=g).to(dev, torch.bfloat16)
    pos = seq.positions.to(dev)  # this rank's THD rows
    ref = kpool_topk(q, k, gates, w, ape, world1, topk=TOPK, kpool=K)
    computed = kpool_topk(q[pos], k[pos], gates[pos], w[pos], ape, seq, topk=TOPK, kpool=K)  # local rows in and out
    ids = computed
    if train:  # the indexer's KL loss on these rows, against world size 1's
        from sp_kpool.testing.training_checks import stream_training_check

        stream = dict(q=q, k=k, gates=gates, head_weights=w, ape=ape)
        return stream_training_check(seq, world1, stream, computed, ref, topk=TOPK, kpool=K, seed=seed, fault=fault)
    agree = True
    if replayed:  # the rollout's per-request capture (no row for each sequence's last token)
        capture = [d[:-1] for d in replay.documents(ref, world1)]
        inputs = dict(q=q[pos], k=k[pos], gates=gates[pos], head_weights=w[pos], ape=ape)
        ids = replayed_ids(capture, seq, topk=TOPK, kpool=K, inputs=inputs)
        agree = replay.compare(ids, computed, seq)["rows_differing"] == 0
    if fault:
        ids = ids.clone()
        ids[-1, 0] = (ids[-1, 0] + 1) % total
    same = torch.equal(ids.cpu(), ref[pos].cpu())
    # Megatron's gathered K: local rows gathered rank by rank, then reordered to stream order
    local_k = k[pos].contiguous()
    parts = [torch.empty((p.numel(), D), dtype=k.dtype, device=dev) for p in seq.rank_positions]
    dist.all_gather(parts, local_k, group=seq.group)
    reordered = torch.cat(parts).index_select(0, key_reorder(seq).to(dev))
    valid = ids >= 0
    indexes_reordered = torch.equal(reordered[ids[valid].long()], k[ids[valid].long()])
    return same and indexes_reordered and agree


def rank_main(rank, world_size, device, inject_fault, replayed=False, train=False):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dev = torch.device(f"cuda:{torch.cuda.current_device()}" if device == "cuda" else "cpu")
    cp_group = dist.new_group(list(range(world_size)))
    p = packed_seq_params(SEQS, world_size)
    packed = check(sharded_sequence(p, cp_group), sharded_sequence(p, world_size=1), dev, 0,
                   inject_fault and rank == 0, replayed, train)  # fmt: skip
    S = 16 * world_size
    nonpacked = check(sharded_sequence(None, cp_group, seq_len=S), sharded_sequence(None, seq_len=S), dev, 1, False,
                      replayed, train)  # fmt: skip
    return packed, nonpacked


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
    for rank, (packed, nonpacked) in enumerate(results):
        print(f"rank {rank}: packed THD {'PASS' if packed else 'FAIL'}, non-packed {'PASS' if nonpacked else 'FAIL'}")
    ok = all(a and b for a, b in results)
    name = "megatron_cp --replay" if args.replay else "megatron_cp --train" if args.train else "megatron_cp"
    print(f"{name} world_size={args.world_size} device={args.device}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
