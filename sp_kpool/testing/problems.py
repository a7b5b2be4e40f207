"""Random problems with a fixed seed, identical on every rank (build global, then slice)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sharding import ShardedSequence

__all__ = ["GlobalInputs", "make_inputs", "shard_inputs", "random_rank_positions", "layout_seqs", "simulate_ranks", "to_document_positions",
           "random_doc_lengths"]


@dataclass
class GlobalInputs:
    """Global (unsharded, unpadded) operator inputs of ``S`` real tokens.

    q ``[S, H, D]``, k ``[S, D]``, gates ``[S, D]``, head_weights ``[S, H]``, ape ``[K, D]``.
    """

    cu_seq_lens: list[int]
    q: torch.Tensor
    k: torch.Tensor
    gates: torch.Tensor
    head_weights: torch.Tensor
    ape: torch.Tensor


def random_doc_lengths(total: int, num_docs: int, seed: int) -> list[int]:
    """``num_docs`` positive lengths summing to ``total`` (``num_docs <= total``)."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(total - 1, generator=g)[: num_docs - 1] + 1
    bounds = [0, *sorted(cuts.tolist()), total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def make_inputs(
    lengths: list[int], *, heads: int, head_dim: int, kpool: int, seed: int = 0, dtype=torch.float32
) -> GlobalInputs:
    """Random inputs for packed documents of the given lengths (CPU, ``dtype``)."""
    S = sum(lengths)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return GlobalInputs(
        cu_seq_lens=cu,
        q=rnd(S, heads, head_dim),
        k=rnd(S, head_dim),
        gates=rnd(S, head_dim),
        head_weights=rnd(S, heads),
        ape=rnd(kpool, head_dim, scale=0.5),
    )


def shard_inputs(x: GlobalInputs, seq: ShardedSequence, device="cpu") -> dict[str, torch.Tensor]:
    """This rank's rows, at ``seq.positions`` of the stream (zero rows for padding), as
    ``kpool_topk`` keyword arguments."""

    def rows(t):
        return seq.local_rows(t).to(device)

    return {
        "q": rows(x.q),
        "k": rows(x.k),
        "gates": rows(x.gates),
        "head_weights": rows(x.head_weights),
        "ape": x.ape.to(device),
    }


def random_rank_positions(total: int, world_size: int, seed: int) -> list[torch.Tensor]:
    """A random ownership of ``total`` stream positions: a random permutation cut into
    ``world_size`` parts at random (uneven, possibly empty) points, from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(total, generator=g)
    cuts = torch.sort(torch.randint(0, total + 1, (world_size - 1,), generator=g)).values.tolist()
    bounds = [0, *cuts, total]
    return [perm[bounds[r] : bounds[r + 1]] for r in range(world_size)]


def layout_seqs(cu_seq_lens, world_size: int, layout: str = "contiguous", pad_multiple: int | None = None,
                rank_positions=None) -> list[ShardedSequence]:  # fmt: skip
    """Every rank's ``ShardedSequence`` of a layout (``rank_positions``: the ``positions``
    layout with these positions per rank)."""
    if rank_positions is not None:
        return [ShardedSequence.from_rank_positions(cu_seq_lens, rank_positions, rank=r) for r in range(world_size)]
    return [ShardedSequence.split(cu_seq_lens, world_size, r, layout=layout, pad_multiple=pad_multiple)
            for r in range(world_size)]  # fmt: skip


def simulate_ranks(x: GlobalInputs, world_size: int, *, topk: int, kpool: int, backend: str = "torch",
                   settings=None, seqs: list[ShardedSequence] | None = None, **options):  # fmt: skip
    """Every rank's output of a ``world_size`` split, computed in this one process.

    The all-gather is replaced by concatenating the ranks' rows (exactly what the
    collective returns); everything after it is the real code path
    (:func:`sp_kpool.pipeline.run_gathered`). ``seqs``: every rank's sequence of another
    layout (:func:`layout_seqs`; default the contiguous split). ``options``: the other
    fields of :class:`~sp_kpool.config.KPoolConfig` (tail, order, alignment, precision,
    max_logits_bytes). Returns the outputs by rank, each ``[S_local, W]`` int32.
    """
    from ..config import KPoolConfig, RunOptions
    from ..pipeline import run_gathered

    if seqs is None:
        seqs = layout_seqs(x.cu_seq_lens, world_size)
    local = [shard_inputs(x, s) for s in seqs]
    k_all = torch.cat([d["k"] for d in local])
    gates_all = torch.cat([d["gates"] for d in local])
    config = KPoolConfig(topk=topk, kpool=kpool, **options)
    return [run_gathered({**d, "k": k_all, "gates": gates_all}, s, config, RunOptions(backend=backend), settings).ids
            for s, d in zip(seqs, local)]  # fmt: skip


def reference_slice_problem(heads: int, precision: str = "bf16", *, total: int = 131072, seed: int = 0,
                            max_logits_bytes: int | None = None, device="cuda", prompt_fraction: float = 0.0):  # fmt: skip
    """The benchmarks' reference workload on CUDA: rank 3 of a 4-rank split of one
    ``total``-token document, D 128, topk 2048, kpool 4, the library's logits budget for
    ``device`` unless ``max_logits_bytes`` is given."""
    from ..settings import current_settings

    budget = max_logits_bytes or current_settings().logits_budget(torch.device(device))
    return rank_slice_problem(total, 4, 3, heads=heads, head_dim=128, topk=2048, precision=precision,
                              max_logits_bytes=budget, seed=seed, device=device,
                              prompt_fraction=prompt_fraction)  # fmt: skip


def rank_slice_problem(
    total: int, world_size: int, rank: int, *, heads: int, head_dim: int, kpool: int = 4, topk: int = 2048,
    device="cuda", precision: str = "bf16", seed: int = 0, exact: bool = False, lengths: list[int] | None = None,
    max_logits_bytes: int = 1 << 30, tail: str = "fixed", order: str = "ascending", prompt_fraction: float = 0.0,
):  # fmt: skip
    """The ``Problem`` that rank ``rank`` of a ``world_size`` split sees after the gather,
    built directly on ``device`` (BF16 inputs): keys and gates of the whole sequence,
    queries and head weights of this rank's rows only. ``lengths`` (default one document
    of ``total`` tokens) describe the packed documents; ``prompt_fraction``: that fraction of
    every document is its prompt (the serving compression schedule, ``prompt_lens``).

    ``exact=True`` makes every score exactly representable in FP32 (small integer keys and
    queries, dyadic head weights, gates that make each pool's slot softmax exactly one-hot
    per channel), so any two correct implementations agree bit for bit, ties included
    (use ``D = 64`` and ``H`` in ``{16, 64}`` so ``D^-0.5`` and ``H^-0.5`` are dyadic).
    """
    from ..backends.base import Problem
    from ..config import KPoolConfig

    lengths = lengths or [total]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    prompts = [int(prompt_fraction * n) for n in lengths] if prompt_fraction else None
    seq = ShardedSequence.split(cu, world_size=world_size, rank=rank, prompt_lens=prompts)
    g = torch.Generator(device=device).manual_seed(seed)
    S, R, H, D = seq.total_length, seq.shard_size, heads, head_dim
    bf = torch.bfloat16

    if exact:
        def ints(*shape, lo=-3, hi=4):
            return torch.randint(lo, hi, shape, generator=g, device=device).to(bf)

        k, q = ints(S, D), ints(R, H, D)
        w = (torch.randint(-2, 3, (R, H), generator=g, device=device).float() * 0.5).to(bf)
        cu_t = torch.tensor(cu, device=device)
        pos = torch.arange(S, device=device)
        doc = torch.searchsorted(cu_t, pos, right=True) - 1
        slot = (pos - cu_t[doc.clamp(max=len(cu) - 2)]) % kpool
        hot = slot[:, None] == (torch.arange(D, device=device) % kpool)[None]
        gates = torch.where(hot, 60.0, -60.0).to(bf)
        ape = torch.zeros(kpool, D, device=device, dtype=bf)
    else:
        k = torch.randn(S, D, generator=g, device=device).to(bf)
        gates = torch.randn(S, D, generator=g, device=device).to(bf)
        ape = (torch.randn(kpool, D, generator=g, device=device) * 0.5).to(bf)
        q = torch.randn(R, H, D, generator=g, device=device).to(bf)
        w = torch.randn(R, H, generator=g, device=device).to(bf)
    config = KPoolConfig(topk=topk, kpool=kpool, tail=tail, order=order, precision=precision,
                         max_logits_bytes=max_logits_bytes)  # fmt: skip
    return Problem(q=q, head_weights=w, k=k, gates=gates, ape=ape, seq=seq, config=config)


def to_document_positions(ids: torch.Tensor, seq: ShardedSequence) -> torch.Tensor:
    """``ids`` (stream positions, ``-1`` kept) as real rows: what they are in a world-size-1
    contiguous call on the same real documents (``AssertionError`` if one is padding)."""
    try:
        return seq.real_ids(ids)
    except ValueError:
        raise AssertionError("an id points at a padding token") from None
