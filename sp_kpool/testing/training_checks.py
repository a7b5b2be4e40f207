"""Rank functions of the training path's multi-rank tests (importable, so that
:func:`sp_kpool.testing.dist.run_ranks` can spawn them): every rank builds the same global
inputs from one seed, computes the world-size-1 loss and gradients in-process, then its
own share under the layout, and reports how far each gradient is from world size 1's."""

from __future__ import annotations

import torch

from ..sharding import ShardedSequence
from .problems import layout_seqs, make_inputs, random_rank_positions

__all__ = ["training_case", "loss_and_grads", "compare_with_world1"]

NAMES = ("q", "k", "gates", "head_weights", "ape")


def training_case(lengths, *, heads=3, head_dim=8, kpool=2, seed=0, dtype=torch.float64, hq=2, dqk=5):
    """Global inputs and a random attention teacher (``q_t``, ``k_t``, ``lse``)."""
    x = make_inputs(lengths, heads=heads, head_dim=head_dim, kpool=kpool, seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    N = sum(lengths)
    teacher = (torch.randn(N, hq, dqk, generator=g, dtype=torch.float64).to(dtype),
               torch.randn(N, dqk, generator=g, dtype=torch.float64).to(dtype),
               (torch.randn(N, hq, generator=g, dtype=torch.float64) + 4).to(torch.float32 if dtype != torch.float64 else dtype))  # fmt: skip
    return x, teacher


def loss_and_grads(x, teacher_rows, seq, *, sparse: bool, teacher_kind: str, topk: int, mass_global=None, **kw):
    """This rank's loss share and gradients (storage order) for ``seq``."""
    import sp_kpool

    local = {n: seq.local_rows(getattr(x, n)) for n in ("q", "k", "gates", "head_weights")}
    leaves = [local["q"], local["k"], local["gates"], local["head_weights"], x.ape.clone()]
    leaves = [t.clone().requires_grad_() for t in leaves]
    K = x.ape.shape[0]
    selection = "dense"
    if sparse:
        selection = sp_kpool.kpool_topk(*(t.detach().float() for t in leaves), seq, topk=topk, kpool=K)
    qt, kt, lse = teacher_rows
    if teacher_kind == "mass":
        teacher = sp_kpool.TokenMass(seq.local_rows(mass_global))
    else:
        teacher = sp_kpool.AttentionTeacher(seq.local_rows(qt), kt, seq.local_rows(lse), 0.5)
    loss = sp_kpool.indexer_kl_loss(*leaves, seq, teacher=teacher, selection=selection, topk=topk, kpool=K, **kw)
    grads = torch.autograd.grad(loss, leaves)
    return loss.detach(), grads, selection


def compare_with_world1(rank, world_size, lengths, layout, kw, sparse, teacher_kind, topk, dtype, seed=0):
    """Run on every rank: ``{"loss": (share sum, ws1), "loss_bitwise", "grads": {name: (max
    |diff|, max |g|, bitwise)}, "repeat_bitwise": two calls equal bit for bit,
    "padding_zero": the padding rows' gradients are zeros}`` (each rank's view of the whole)."""
    import torch.distributed as dist

    x, teacher = training_case(lengths, kpool=kw.pop("kpool", 2), dtype=dtype, seed=seed)
    cu = x.cu_seq_lens
    if layout == "positions":
        seq = ShardedSequence.from_rank_positions(cu, random_rank_positions(sum(lengths), world_size, seed), rank=rank,
                                                  group=dist.group.WORLD)  # fmt: skip
    else:
        seq = ShardedSequence.split(cu, world_size, rank, dist.group.WORLD, layout=layout)
    one = layout_seqs(cu, 1)[0]
    mass = None
    if teacher_kind == "mass":
        import sp_kpool

        ids1 = sp_kpool.kpool_topk(x.q.float(), x.k.float(), x.gates.float(), x.head_weights.float(), x.ape.float(), one,
                                   topk=topk, kpool=x.ape.shape[0])  # fmt: skip
        g = torch.Generator().manual_seed(seed + 7)
        mass = (torch.rand(ids1.shape, generator=g, dtype=torch.float64) * (ids1 >= 0)).to(dtype)
    l1, g1, _ = loss_and_grads(x, teacher, one, sparse=sparse, teacher_kind=teacher_kind, topk=topk, mass_global=mass,
                               **kw)  # fmt: skip
    lw, gw, _ = loss_and_grads(x, teacher, seq, sparse=sparse, teacher_kind=teacher_kind, topk=topk, mass_global=mass,
                               **kw)  # fmt: skip
    lw2, gw2, _ = loss_and_grads(x, teacher, seq, sparse=sparse, teacher_kind=teacher_kind, topk=topk,
                                 mass_global=mass, **kw)  # fmt: skip
    repeat = bool(torch.equal(lw, lw2)) and all(torch.equal(a, b) for a, b in zip(gw, gw2))
    losses = [torch.zeros_like(lw.reshape(1)) for _ in range(world_size)]
    dist.all_gather(losses, lw.reshape(1).contiguous())
    apes = [torch.zeros_like(gw[4]) for _ in range(world_size)]
    dist.all_gather(apes, gw[4].contiguous())
    total_loss = sum(losses[1:], losses[0])[0]
    out = {"loss": (float(total_loss), float(l1)), "loss_bitwise": bool(torch.equal(total_loss, l1)), "grads": {},
           "repeat_bitwise": repeat}  # fmt: skip
    pad = seq.padding_rows
    out["padding_zero"] = all(bool((gw[i][pad] == 0).all()) for i in range(4))
    for i, name in enumerate(NAMES):
        if name == "ape":
            whole = sum(apes[1:], apes[0])
        else:
            whole = seq.global_rows(gw[i])
        ref = g1[i]
        out["grads"][name] = (float((whole - ref).abs().max()), float(ref.abs().max()), bool(torch.equal(whole, ref)))
    return out
