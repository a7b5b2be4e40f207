"""One chunk of rows: the student's scores, the KL terms and their unit gradients.

Everything here is row-local and runs on a chunk of the **global** row grid (``C`` rows,
other ranks' rows as zero rows), so a row's values have the same bits whichever rank
computes it, in whatever layout (the frozen operator's rule, ``docs/contract.md`` section 7).

Scores as the contract's section 3 in the compute type ``ct = max(FP32, dtype)``:
``a = (q . key) / sqrt(D)`` per head, ``s = sum_h (w_h / sqrt(H)) ReLU(a_h)``. With
``m^ = m / sum_{C_t} m`` and ``l = log_softmax_{C_t}(s)``, a row's term is
``sum_p m^ (log m^ - l_p)`` (``0 log 0 = 0``) and ``dL/ds = scale * (softmax - m^)``.
Then, for the chunk: ``dw[t, h] = H^-1/2 sum_p ds r``; ``da = ds * w / sqrt(H) * 1[a > 0]``;
``dq = D^-1/2 da @ keys``; ``dkey = D^-1/2 da^T @ q`` (the cross-row term).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ChunkGrads", "kl_terms", "sparse_chunk", "dense_chunk"]


@dataclass
class ChunkGrads:
    """A chunk's terms ``[C]`` (unscaled KL per row) and, when asked for, its unit gradients
    (scaled by ``coeff / N``): ``dq [C, H, D]``, ``dw [C, H]``, and the pooled keys' terms:
    ``dkeys [C, slots, D]`` per row and candidate (sparse), or ``[N, D]`` summed over the
    chunk's rows (dense), or ``None``."""

    terms: torch.Tensor
    dq: torch.Tensor | None = None
    dw: torch.Tensor | None = None
    dkeys: torch.Tensor | None = None


def kl_terms(s: torch.Tensor, mass: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``s [C, n]`` (scores), ``mass [C, n]`` (teacher, ``>= 0``) and ``valid
    [C, n]`` (the row's candidates): the KL term ``[C]`` and ``softmax - m^`` ``[C, n]``
    (zero in rows without candidates or mass, and outside the candidates)."""
    neg = torch.tensor(float("-inf"), dtype=s.dtype)
    sm = torch.where(valid, s, neg)
    mx = sm.amax(dim=1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    e = (sm - mx).exp()
    z = e.sum(dim=1, keepdim=True)
    some = z > 0
    z = torch.where(some, z, torch.ones_like(z))
    lsm = s - (z.log() + mx)
    m = torch.where(valid, mass, torch.zeros_like(mass))
    total = m.sum(dim=1, keepdim=True)
    active = (total > 0) & some
    mh = torch.where(active, m / torch.where(active, total, torch.ones_like(total)), torch.zeros_like(m))
    pos = mh > 0
    logm = torch.where(pos, mh, torch.ones_like(mh)).log()
    terms = torch.where(pos, mh * (logm - lsm), torch.zeros_like(mh)).sum(dim=1)
    diff = torch.where(active & valid, e / z - mh, torch.zeros_like(mh))
    return terms, diff


def _scores(a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ReLU(a)`` ``[C, H, n]`` (in place: ``a`` is not needed after it, ``r > 0`` is
    ``a > 0``), ``w / sqrt(H)`` ``[C, H]`` and ``s`` ``[C, n]``."""
    H = w.shape[1]
    r = a.relu_()
    wh = w * H**-0.5
    return r, wh, torch.bmm(wh.unsqueeze(1), r).squeeze(1)


def _head_grads(r, wh, diff, scale):
    """``dw [C, H]`` and ``da [C, H, n]`` (with the ``D^-1/2`` of ``a`` left out)."""
    H = wh.shape[1]
    ds = diff * scale
    dw = torch.bmm(r, ds.unsqueeze(2)).squeeze(2) * H**-0.5
    da = wh.unsqueeze(2) * ds.unsqueeze(1)
    return dw, da.masked_fill_(r <= 0, 0)  # ReLU's gradient: 1[a > 0]


def sparse_chunk(q, w, keys, valid, mass, scale: float, grads: bool) -> ChunkGrads:
    """Sparse candidates: ``q [C, H, D]``, ``w [C, H]``, ``keys [C, n, D]`` (each row's
    candidates' pooled keys), ``valid``/``mass`` ``[C, n]``; all in the compute type."""
    D = q.shape[2]
    a = torch.bmm(q, keys.transpose(1, 2)).mul_(D**-0.5)  # [C, H, n]
    r, wh, s = _scores(a, w)
    terms, diff = kl_terms(s, mass, valid)
    if not grads:
        return ChunkGrads(terms)
    dw, da = _head_grads(r, wh, diff, scale)
    dq = torch.bmm(da, keys).mul_(D**-0.5)
    dkeys = torch.bmm(da.transpose(1, 2), q).mul_(D**-0.5)  # [C, n, D]
    return ChunkGrads(terms, dq, dw, dkeys)


def dense_chunk(q, w, keys, valid, mass, scale: float, grads: bool, per_row: int = 0) -> ChunkGrads:
    """Dense candidates: ``keys [N, D]`` (a pool range shared by the chunk's rows),
    ``valid``/``mass`` ``[C, N]``. ``per_row``: also return the pooled keys' terms per row,
    ``[C, N, D]`` in blocks of ``per_row`` rows, as ``dkeys`` (the exact mode's fixed-point
    sum needs them row by row); ``0``: ``dkeys [N, D]`` summed over the chunk."""
    C, H, D = q.shape
    a = torch.matmul(q.reshape(C * H, D), keys.t()).view(C, H, -1).mul_(D**-0.5)
    r, wh, s = _scores(a, w)
    terms, diff = kl_terms(s, mass, valid)
    if not grads:
        return ChunkGrads(terms)
    dw, da = _head_grads(r, wh, diff, scale)
    dq = torch.matmul(da.reshape(C * H, -1), keys).view(C, H, D).mul_(D**-0.5)
    if per_row:
        return ChunkGrads(terms, dq, dw, (da, q))  # the caller walks blocks of rows (exact.row_terms)
    dkeys = torch.matmul(da.reshape(C * H, -1).t(), q.reshape(C * H, D)).mul_(D**-0.5)
    return ChunkGrads(terms, dq, dw, dkeys)


def dense_row_terms(da: torch.Tensor, q: torch.Tensor, rows: slice) -> torch.Tensor:
    """The pooled keys' terms of the rows ``rows`` of a dense chunk, row by row:
    ``[b, N, D] = D^-1/2 da[t]^T @ q[t]``."""
    D = q.shape[2]
    return torch.bmm(da[rows].transpose(1, 2), q[rows]).mul_(D**-0.5)
