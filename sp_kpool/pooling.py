"""Pool layout (which tokens form which pool) and compression in the model arithmetic.

Pools restart at every document start. Document ``d`` of length ``L`` owns ``L // K``
*complete* pools; a partial last pool is never selectable, so it is never built. Pools are
numbered globally in document order::

    cu_seq_lens = [0, 9, 14], K = 4
    tokens      0 1 2 3 | 4 5 6 7 | 8    9 10 11 12 | 13
    pool id     0         1         -    2            -
    pool_tok_start = [0, 4, 9]

Only real documents contribute pools (the padding document of a ``ShardedSequence`` never
does), so the pool table is the same for every world size.
"""

from __future__ import annotations

import torch

from .checks import check_int

__all__ = ["pool_table", "extend_pools", "compress_pools_bf16"]


def pool_table(cu_seq_lens: torch.Tensor, kpool: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Complete pools of the documents in ``cu_seq_lens``.

    Args:
        cu_seq_lens: ``[num_docs + 1]``, int64, CPU, real documents only.
        kpool: pool size ``K``.

    Returns:
        pool_tok_start: ``[P]``, int64, CPU: global token id of slot 0 of each pool.
        doc_pool_offset: ``[num_docs + 1]``, int64, CPU: global id of each document's
            first pool (a cumulative sum of ``len_d // K``).
    """
    lengths = cu_seq_lens[1:] - cu_seq_lens[:-1]
    counts = lengths // kpool
    doc_pool_offset = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    doc_pool_offset[1:] = torch.cumsum(counts, 0)
    total = int(doc_pool_offset[-1])
    # pool p of document d starts at cu[d] + (p - offset[d]) * K = (cu[d] - offset[d] * K) + p * K:
    # no gathers (they took milliseconds of host time per call at 32768 pools on the GPU host)
    shift = cu_seq_lens[:-1].to(torch.int64) - doc_pool_offset[:-1] * kpool
    pool_tok_start = torch.repeat_interleave(shift, counts, output_size=total)
    pool_tok_start += torch.arange(0, total * kpool, kpool, dtype=torch.int64)
    return pool_tok_start, doc_pool_offset


def extend_pools(real_cu_seq_lens: torch.Tensor, prompt_lens, kpool: int) -> torch.Tensor:
    """Which complete pools serving compresses in the extend (prefill) order.

    Pool ``p`` (document-local) of document ``d`` closed during the prefill of a prompt of
    ``prompt_lens[d]`` tokens when its last token lies in the prompt: ``(p + 1) * K <=
    prompt_lens[d]``, i.e. ``p < prompt_lens[d] // K``; every other pool was closed by a
    decoding forward (decode order)::

        K = 4, document of 14 tokens, prompt of 9
        tokens   0 1 2 3 | 4 5 6 7 | 8 . . . 12 13
        prompt   ------------------- 8 |
        pools    0 extend  1 extend  2 decode    (13: partial, never built)

    Args:
        real_cu_seq_lens: ``[num_docs + 1]`` int64 (CPU), real documents only.
        prompt_lens: one int per real document (``0 <= P_d <= len_d``).
        kpool: pool size ``K``.

    Returns:
        ``[P]`` bool (CPU), in the order of :func:`pool_table`.
    """
    lengths = (real_cu_seq_lens[1:] - real_cu_seq_lens[:-1]).tolist()
    prompt_lens = list(prompt_lens)
    if len(prompt_lens) != len(lengths):
        raise ValueError(f"prompt_lens: expected one length per document ({len(lengths)}), got {len(prompt_lens)}")
    for d, (p, n) in enumerate(zip(prompt_lens, lengths)):
        check_int(f"prompt_lens[{d}]", p)
        if not 0 <= p <= n:
            raise ValueError(f"prompt_lens[{d}]: expected 0 <= prompt_lens[{d}] <= len = {n}, got {p}")
    parts = [torch.arange(n // kpool) < p // kpool for n, p in zip(lengths, prompt_lens)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)


def compress_pools_bf16(
    k: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor, pool_tok_start: torch.Tensor
) -> torch.Tensor:
    """Pool keys in the model-definition arithmetic (contract §2, ``Glm5NextTextIndexer``).

    ``pool_key[p, c] = sum_s softmax_s(g[tok(p, s), c] + ape[s, c]) * k[tok(p, s), c]``:
    the softmax over the slot axis runs in FP32 per channel, the probabilities are cast to
    ``k.dtype`` and the weighted sum is taken in ``k.dtype``.

    Args:
        k: ``[S, D]``, float (BF16 in the model, FP32 in tests): layer-normed keys of the
            whole (gathered) sequence.
        gates: ``[S, D]``, float: per-channel gate logits ``x @ index_kpool_compress_gate.T``.
        ape: ``[K, D]``, float: per-slot, per-channel additive bias.
        pool_tok_start: ``[P]``, int64, on ``k.device``: first token of each pool.

    Returns:
        ``[P, D]`` in ``k.dtype``.
    """
    kpool = ape.shape[0]
    idx = pool_tok_start[:, None] + torch.arange(kpool, device=k.device)
    grouped_k = k[idx]  # [P, K, D]
    logits = gates[idx].float() + ape.float()[None]
    probs = logits.softmax(dim=1).to(k.dtype)
    return (probs * grouped_k).sum(dim=1)
