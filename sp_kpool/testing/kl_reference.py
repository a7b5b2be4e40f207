"""An independent, naive transcription of the indexer's KL loss (``docs/contract.md``
section 13) with plain autograd, one row at a time, on the whole sequence (world size 1).
For tests on tiny inputs only: it shares no code with :mod:`sp_kpool.training`."""

from __future__ import annotations

import torch

__all__ = ["kl_loss_reference"]


def kl_loss_reference(q, k, gates, w, ape, cu_seq_lens, *, selection=None, token_mass=None, attention=None,
                      coeff: float = 1.0) -> torch.Tensor:  # fmt: skip
    """The world-size-1 loss of real rows ``[N]`` (differentiable in every float input).

    q ``[N, H, D]``, k/gates ``[N, D]``, w ``[N, H]``, ape ``[K, D]``; ``selection``:
    ``[N, width]`` real-token ids (sparse) or ``None`` (dense); ``token_mass``: ``[N, width]``
    aligned with ``selection``; ``attention``: ``(q_t [N, Hq, Dq], k_t [N, Dq], lse [N, Hq],
    scale)``.
    """
    K = ape.shape[0]
    H, D = q.shape[1], q.shape[2]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    cu = [int(v) for v in cu_seq_lens]
    total, count = q.new_zeros((), dtype=ct), 0
    for d in range(len(cu) - 1):
        a, n = cu[d], cu[d + 1] - cu[d]
        pools = []
        for p in range(n // K):
            tok = slice(a + p * K, a + (p + 1) * K)
            probs = (gates[tok].to(ct) + ape.to(ct)).softmax(dim=0).to(k.dtype)
            pools.append((probs * k[tok]).sum(dim=0))
        for j in range(n):
            t = a + j
            if j + 1 < K:
                continue
            count += 1
            visible = list(range((j + 1) // K))
            if selection is not None:
                ids = [int(x) for x in selection[t] if int(x) >= 0]
                cand = [p for p in visible if all(a + p * K + s in ids for s in range(K))]
            else:
                cand = visible
            if not cand:
                continue
            keys = torch.stack([pools[p] for p in cand]).to(ct)
            s = (torch.relu((q[t].to(ct) @ keys.t()) / D**0.5) * (w[t].to(ct)[:, None] / H**0.5)).sum(dim=0)
            if token_mass is not None:
                cols = [int(x) for x in selection[t]]
                m = torch.stack([sum(token_mass[t, c].to(ct) for c, x in enumerate(cols) if x >= 0 and
                                     (x - a) // K == p and x - a < (p + 1) * K and x >= a) for p in cand])  # fmt: skip
            else:
                qt, kt, lse, scale = attention
                m = torch.stack([torch.exp(qt[t].to(ct) @ kt[a + p * K : a + (p + 1) * K].to(ct).t() * scale
                                           - lse[t].to(ct)[:, None]).sum() for p in cand])  # fmt: skip
            m = m.detach()
            if float(m.sum()) <= 0:
                continue
            mh = m / m.sum()
            logp = torch.log_softmax(s, dim=0)
            total = total + torch.where(mh > 0, mh * (torch.log(torch.where(mh > 0, mh, 1)) - logp), 0).sum()
    return total * coeff / max(count, 1)
