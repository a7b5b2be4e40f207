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
    """This rank's loss share, gradients (storage order), selection and the call's ``stats``
    for ``seq``."""
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
    stats = {}
    loss = sp_kpool.indexer_kl_loss(*leaves, seq, teacher=teacher, selection=selection, topk=topk, kpool=K, stats=stats,
                                    **kw)  # fmt: skip
    grads = torch.autograd.grad(loss, leaves)
    return loss.detach(), grads, selection, stats


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
    l1, g1, _, _ = loss_and_grads(x, teacher, one, sparse=sparse, teacher_kind=teacher_kind, topk=topk, mass_global=mass,
                               **kw)  # fmt: skip
    lw, gw, _, stats = loss_and_grads(x, teacher, seq, sparse=sparse, teacher_kind=teacher_kind, topk=topk, mass_global=mass,
                               **kw)  # fmt: skip
    lw2, gw2, _, _ = loss_and_grads(x, teacher, seq, sparse=sparse, teacher_kind=teacher_kind, topk=topk,
                                 mass_global=mass, **kw)  # fmt: skip
    balanced = stats["balance_applied"]
    repeat = bool(torch.equal(lw, lw2)) and all(torch.equal(a, b) for a, b in zip(gw, gw2))
    losses = [torch.zeros_like(lw.reshape(1)) for _ in range(world_size)]
    dist.all_gather(losses, lw.reshape(1).contiguous())
    apes = [torch.zeros_like(gw[4]) for _ in range(world_size)]
    dist.all_gather(apes, gw[4].contiguous())
    total_loss = sum(losses[1:], losses[0])[0]
    out = {"loss": (float(total_loss), float(l1)), "loss_bitwise": bool(torch.equal(total_loss, l1)), "grads": {},
           "repeat_bitwise": repeat, "balance_applied": balanced}  # fmt: skip
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


def indexer_module(dtype=torch.float64, seed=0, **kw):
    """A small trainable ``KPoolIndexer`` with random parameters (the same on every rank)."""
    from ..indexer import KPoolIndexer

    m = KPoolIndexer(hidden_size=12, q_lora_rank=10, index_n_heads=3, index_head_dim=8, index_topk=4, index_kpool=2,
                     trainable=True, dtype=dtype, **kw)  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    return m


def module_inputs(lengths, seed=0, dtype=torch.float64, hq=2, dqk=6):
    """``hidden [N, 12]``, ``q_resid [N, 10]`` and an attention teacher ``(q_t, k_t, lse)``."""
    g = torch.Generator().manual_seed(seed + 11)
    N = sum(lengths)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    return rnd(N, 12), rnd(N, 10), (rnd(N, hq, dqk), rnd(N, dqk), (rnd(N, hq) + 4))


def module_step(rank, world_size, lengths, layout, determinism, dense):
    """One training step of :func:`indexer_module` on every rank: the loss share and each
    parameter's gradient, all-reduced (summed) over the ranks as a framework does, next to
    world size 1's; ``{"loss": (sum, ws1), "grads": {name: (max |diff|, max |g|, bitwise)}}``."""
    import torch.distributed as dist

    import sp_kpool

    hidden, q_resid, (qt, kt, lse) = module_inputs(lengths)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)

    def step(seq):
        m = indexer_module()
        m(seq.local_rows(hidden), seq.local_rows(q_resid), seq)
        teacher = sp_kpool.AttentionTeacher(seq.local_rows(qt), kt, seq.local_rows(lse), 0.4)
        loss = m.kl_loss(teacher, selection="dense" if dense else None, determinism=determinism)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in m.named_parameters()}

    l1, g1 = step(layout_seqs(cu, 1)[0])
    seq = ShardedSequence.split(cu, world_size, rank, dist.group.WORLD, layout=layout)
    lw, gw = step(seq)
    dist.all_reduce(lw)
    out = {"loss": (float(lw), float(l1)), "grads": {}}
    for name, g in gw.items():
        dist.all_reduce(g)
        out["grads"][name] = (float((g - g1[name]).abs().max()), float(g1[name].abs().max()), bool(torch.equal(g, g1[name])))
    return out


def stream_training_check(seq, world1, stream: dict, ids, ids1, *, topk: int, kpool: int, alignment: int = 1,
                          seed: int = 0, fault: bool = False, tol: float = 1e-5) -> bool:  # fmt: skip
    """The examples' training step: this rank's ``indexer_kl_loss`` (a random ``TokenMass``
    aligned with its ids) against world size 1's on the whole stream.

    ``stream``: ``q``, ``k``, ``gates``, ``head_weights`` of the whole padded stream (stream
    order) and ``ape``; ``ids``/``ids1``: this rank's ids (its rows, storage order) and the
    world-size-1 ids of the stream. The inputs are taken in FP32. Every rank checks its
    rows' gradients (within ``tol * max|g|`` of world size 1's), and the loss shares' and
    ``ape``'s gradients' sums over the ranks; ``fault`` perturbs one gradient (the check
    must then fail). A collective."""
    import torch.distributed as dist

    import sp_kpool

    g = torch.Generator().manual_seed(seed + 101)
    mass1 = torch.rand(ids1.shape, generator=g).to(ids1.device) * (ids1 >= 0)
    kw = dict(topk=topk, kpool=kpool, alignment=alignment)
    leaves1 = [stream[n].detach().float().requires_grad_() for n in NAMES]
    loss1 = sp_kpool.indexer_kl_loss(*leaves1, world1, teacher=sp_kpool.TokenMass(mass1), selection=ids1, **kw)
    grads1 = torch.autograd.grad(loss1, leaves1)
    pos = seq.positions.to(ids1.device)
    leaves = [stream[n].detach().float()[pos].requires_grad_() for n in NAMES[:4]]
    leaves.append(stream["ape"].detach().float().requires_grad_())
    mass = mass1[pos] * (ids >= 0)
    loss = sp_kpool.indexer_kl_loss(*leaves, seq, teacher=sp_kpool.TokenMass(mass), selection=ids, **kw)
    grads = list(torch.autograd.grad(loss, leaves))
    if fault:
        grads[0] = grads[0].clone()
        grads[0].view(-1)[0] += 1e-3 * float(grads1[0].abs().max()) + 1e-30
    share = loss.detach().clone()
    dist.all_reduce(share, group=seq.group)
    dist.all_reduce(grads[4], group=seq.group)
    one = float(loss1.detach())
    ok = abs(float(share) - one) <= tol * abs(one) and one > 0
    for i, (a, b) in enumerate(zip(grads, grads1)):
        ref = b if i == 4 else b[pos]
        ok = ok and float((a - ref).abs().max()) <= tol * float(b.abs().max()) and float(b.abs().max()) > 0
    return ok
