"""Synthetic captures for a parity replay: random weights and inputs, real shapes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .arms import _device

__all__ = ["make_synthetic_capture"]


@torch.no_grad()
def make_synthetic_capture(
    directory: str | os.PathLike,
    *,
    tokens: int = 4096,
    docs: int = 1,
    world_size: int = 1,
    hidden_size: int = 4096,
    q_lora_rank: int = 1536,
    heads: int = 32,
    head_dim: int = 128,
    topk: int = 2048,
    kpool: int = 4,
    precision: str = "bf16",
    max_logits_bytes: int | None = None,
    backend: str = "torch",
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    seed: int = 0,
    tag: str = "synthetic",
    prompt_lens: list[int] | float | None = None,
) -> list[Path]:
    """Random, real-shaped capture files (one per rank), as a live call would write them.

    Parameters are scaled like a trained layer (``N(0, 1/fan_in)`` projections, LayerNorm
    weight ``1 + N(0, 1)``, ``ape ~ N(0, 0.25)``), hidden states and ``q_resid`` are
    ``N(0, 1)``; everything is drawn on the CPU from ``seed`` (the same bits on any device).
    World size 1 runs the real ``KPoolIndexer.forward`` with its capture hook. More ranks
    simulate the live ranks in this process: each rank's rows are prepared on their own,
    keys and gates are concatenated (what the all-gather returns), and each rank's ids come
    from the operator's real pipeline. ``prompt_lens``: the documents' prompt lengths (one
    per document; see ``ShardedSequence.prompt_lens``), recorded in the capture, or a float
    in ``[0, 1]``: that fraction of every document. Returns the paths, by rank.
    """
    from .. import capture as cap_mod
    from .. import pipeline
    from ..indexer import KPoolIndexer
    from ..sharding import ShardedSequence
    from ..testing.problems import random_doc_lengths

    dev = _device(device)
    lengths = random_doc_lengths(tokens, docs, seed=seed) if docs > 1 else [tokens]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    mod = KPoolIndexer(
        hidden_size=hidden_size, q_lora_rank=q_lora_rank, index_n_heads=heads, index_head_dim=head_dim,
        index_topk=topk, index_kpool=kpool, backend=backend, precision=precision, max_logits_bytes=max_logits_bytes,
        device=dev, dtype=dtype,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    for name, p in mod.named_parameters():
        if name == "k_norm.weight":
            v = 1.0 + torch.randn(p.shape, generator=g)
        elif name == "k_norm.bias":
            v = torch.randn(p.shape, generator=g)
        elif name == "index_kpool_compress_ape":
            v = 0.5 * torch.randn(p.shape, generator=g)
        else:
            v = torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5
        p.copy_(v.to(dtype))
    if isinstance(prompt_lens, float):
        prompt_lens = [int(prompt_lens * n) for n in lengths]
    seqs = [ShardedSequence.split(cu, world_size=world_size, rank=r, prompt_lens=prompt_lens) for r in range(world_size)]
    S = seqs[0].total_length
    hidden = torch.zeros(S, hidden_size, dtype=dtype)
    q_resid = torch.zeros(S, q_lora_rank, dtype=dtype)
    hidden[:tokens] = torch.randn(tokens, hidden_size, generator=g).to(dtype)
    q_resid[:tokens] = torch.randn(tokens, q_lora_rank, generator=g).to(dtype)
    hidden, q_resid = hidden.to(dev), q_resid.to(dev)
    if world_size == 1:
        hook = cap_mod.enable(mod, directory, calls=1, tag=tag)
        hook.source = "synthetic"
        mod(hidden, q_resid, seqs[0])
        return [cap_mod.capture_path(directory, tag, 0, 0, 1)] if hook.done else []
    parts = [(hidden[s.shard_start : s.shard_end], q_resid[s.shard_start : s.shard_end]) for s in seqs]
    prepared = [mod.prepare(h, qr, precision) for h, qr in parts]
    k_all = torch.cat([p["k"] for p in prepared])
    g_all = torch.cat([p["gates"] for p in prepared])
    config = mod.config.replace(precision=precision).resolve(mod.settings, hidden.device)
    paths = []
    for s, p, (h, qr) in zip(seqs, prepared, parts):
        # the all-gather replaced by the concatenation it returns; the rest is the real pipeline
        res = pipeline.run_gathered({**p, "k": k_all, "gates": g_all}, s, config, mod.options, mod.settings)
        ids, chosen = res.ids, res.call.backend
        meta = {
            "topk": topk, "kpool": kpool, "heads": heads, "tail": "fixed", "order": "ascending", "alignment": 1,
            "max_logits_bytes": config.max_logits_bytes, "precision": precision, "backend": backend,
            "backend_resolved": chosen.name, "device": str(dev), "autocast": "off", "tag": tag, "call": 0,
            "source": f"synthetic (simulated {world_size} ranks)", "head_gate": "fp32",
            "config": json.dumps(config.record(), sort_keys=True),
            "options": json.dumps(mod.options.record(), sort_keys=True),
        }  # fmt: skip
        path = cap_mod.capture_path(directory, tag, 0, s.rank, world_size)
        cap_mod.write_capture(path, hidden=h, q_resid=qr, ids=ids, seq=s, params=dict(mod.state_dict()), meta=meta)
        paths.append(path)
    return paths
