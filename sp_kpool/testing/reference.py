"""References we did not write, and tie-aware comparison (contract §9).

* :func:`transformers_rows`: ``transformers``' ``Glm5NextTextIndexer`` applied per
  document of a packed sequence (it is single-sequence), ids made global.
* :func:`float64_scores`: an independent float64 recomputation of pools and scores, used
  only to judge whether a differing selection is a near-tie.
"""

from __future__ import annotations

import torch

from ..pooling import pool_table

__all__ = ["transformers_indexer", "transformers_rows", "float64_scores", "tie_aware_mismatches"]


def transformers_indexer(*, hidden_size, q_lora_rank, heads, head_dim, topk, kpool, seed=0):
    """A ``Glm5NextTextIndexer`` (FP32) with random weights; needs ``transformers`` >= 5.17."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    cfg = Glm5NextTextConfig(
        hidden_size=hidden_size,
        q_lora_rank=q_lora_rank,
        index_n_heads=heads,
        index_head_dim=head_dim,
        index_topk=topk,
        index_kpool=kpool,
        index_kpool_always_select_tail=True,
        num_hidden_layers=1,
    )
    mod = Glm5NextTextIndexer(cfg, layer_idx=0).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mod.named_parameters():
            scale = 1.0 if "norm" in name else (0.5 if "ape" in name else p.shape[-1] ** -0.5)
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if name == "k_norm.weight" else 0.0))
    return mod


@torch.no_grad()
def transformers_rows(mod, hidden: torch.Tensor, q_resid: torch.Tensor, cu_seq_lens) -> list[frozenset[int]]:
    """Per global row, the set of global token ids the reference selects.

    ``hidden [S, hidden]``, ``q_resid [S, q_lora_rank]`` (FP32); one forward per document.
    """
    cu = [int(v) for v in cu_seq_lens]
    rows: list[frozenset[int]] = []
    for a, b in zip(cu, cu[1:]):
        if b == a:
            continue
        n = b - a
        ids = mod(hidden[None, a:b], q_resid[None, a:b], torch.ones(1, n, dtype=torch.bool), None)[0]
        rows.extend(frozenset(v + a for v in r.tolist() if v >= 0) for r in ids)
    return rows


@torch.no_grad()
def float64_scores(q, k, gates, head_weights, ape, cu_seq_lens, kpool):
    """``(scores [S, P] float64, token_pool [S] int64)``: every row against every pool.

    Pools by a float64 softmax over the slots; score per contract §3. ``token_pool[t]`` is the
    global pool holding token ``t`` (``-1`` if its pool is partial). Small inputs only.
    """
    cu = torch.as_tensor(list(cu_seq_lens), dtype=torch.int64)
    starts, _ = pool_table(cu, kpool)
    idx = starts[:, None] + torch.arange(kpool)
    logit = gates.double()[idx] + ape.double()[None]
    pk = (logit.softmax(1) * k.double()[idx]).sum(1)  # [P, D]
    H, D = q.shape[1], q.shape[2]
    s = torch.relu(torch.einsum("shd,pd->shp", q.double(), pk) * D**-0.5)
    scores = torch.einsum("sh,shp->sp", head_weights.double() * H**-0.5, s)
    token_pool = torch.full((q.shape[0],), -1, dtype=torch.int64)
    token_pool[idx.flatten()] = torch.arange(starts.numel()).repeat_interleave(kpool)
    return scores, token_pool


def tie_aware_mismatches(ours, ref, scores, token_pool, cu_seq_lens, *, topk, kpool, rows=None, rel_tol=1e-4):
    """Rows whose token sets differ by more than a near-tie.

    ``ours``/``ref``: per-row sets of global ids (``rows`` gives their global row ids,
    default ``0..``). A differing row is accepted when every pool in the symmetric
    difference has a float64 score within ``rel_tol * max|score| (+1e-9)`` of the
    selection boundary (the ``topk // kpool``-th best score among the row's visible pools).
    Returns ``[(row, ours_only_pools, ref_only_pools)]`` of the rows not accepted.
    """
    import bisect

    cu = [int(v) for v in cu_seq_lens]
    rows = list(range(len(ours))) if rows is None else list(rows)
    bad = []
    for t, a, b in zip(rows, ours, ref):
        if a == b:
            continue
        pa = {int(token_pool[v]) for v in a - b}
        pb = {int(token_pool[v]) for v in b - a}
        if -1 in pa or -1 in pb:  # a tail token or a partial pool differs: never a tie
            bad.append((t, pa, pb))
            continue
        start = cu[bisect.bisect_right(cu, t) - 1]
        last = t - (t - start + 1) % kpool  # last token of the last complete visible pool
        vis = sorted({int(token_pool[x]) for x in range(start, last + 1)})
        srow = scores[t]
        ranked = torch.sort(srow[vis], descending=True).values
        boundary = float(ranked[min(topk // kpool, len(vis)) - 1])
        tol = rel_tol * float(srow[vis].abs().max()) + 1e-9
        if any(abs(float(srow[p]) - boundary) > tol for p in pa | pb):
            bad.append((t, pa, pb))
    return bad
