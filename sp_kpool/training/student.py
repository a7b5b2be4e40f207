"""One chunk of rows: the student's scores, the KL terms and their unit gradients.

Everything here is row-local and runs on a chunk of the **global** row grid (``C`` rows,
other ranks' rows as zero rows), so a row's values have the same bits whichever rank
computes it, in whatever layout (the frozen operator's rule, ``docs/contract.md`` section 7).

Scores as the contract's section 3 in the compute type ``ct = max(FP32, dtype)``:
``a = (q . key) / sqrt(D)`` per head, ``s = sum_h (w_h / sqrt(H)) ReLU(a_h)``. With
``m^ = m / sum_{C_t} m`` and ``l = log_softmax_{C_t}(s)``, a row's term is
``sum_p m^ (log m^ - l_p)`` (``0 log 0 = 0``) and ``dL/ds = scale * (softmax - m^)``.
Then, for the chunk: ``dw[t, h] = H^-1/2 sum_p ds r``; ``da = ds * (w / sqrt(H) / sqrt(D)) *
1[a > 0]``; ``dq = da @ keys``; ``dkey = da^T @ q`` (the cross-row term).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ChunkGrads", "Workspace", "kl_terms", "sparse_chunk", "dense_chunk"]


class Workspace:
    """Scratch buffers reused from chunk to chunk of one call (fresh large allocations cost
    page faults on every chunk: on the CPU a gather into a new 50 MB tensor took 5x the time
    of the same gather into a reused one). Nothing a chunk returns aliases them."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= int(d)
        b = self._buffers.get(name)
        if b is None or b.numel() < n or b.dtype != dtype or b.device != torch.device(device):
            grow = b.numel() * 2 if b is not None and b.dtype == dtype else 0  # growing chunks: few reallocations
            b = torch.empty(max(n, grow), dtype=dtype, device=device)
            self._buffers[name] = b
        return b[:n].view(*shape)


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


def _head_grads(r, wh, diff, scale, D: int, ws: Workspace):
    """``dw [C, H]`` and ``da [C, H, n]``, the latter times the ``D^-1/2`` of ``a`` (folded into
    the ``[C, H]`` weights: ``dq`` and the keys' terms are then plain products)."""
    H = wh.shape[1]
    ds = diff * scale
    dw = torch.bmm(r, ds.unsqueeze(2)).squeeze(2) * H**-0.5
    raw = torch.mul((wh * D**-0.5).unsqueeze(2), ds.unsqueeze(1), out=ws.get("da_raw", r.shape, r.dtype, r.device))
    da = ws.get("da", r.shape, r.dtype, r.device)
    torch.ops.aten.threshold_backward.grad_input(raw, r, 0, grad_input=da)  # ReLU's gradient: where r > 0, else 0
    return dw, da


def sparse_chunk(q, w, keys, valid, mass, scale: float, grads: bool, ws: Workspace | None = None) -> ChunkGrads:
    """Sparse candidates: ``q [C, H, D]``, ``w [C, H]``, ``keys [C, n, D]`` (each row's
    candidates' pooled keys), ``valid``/``mass`` ``[C, n]``; all in the compute type.
    ``ws``: scratch reused across chunks (``dq`` and ``dkeys`` live in it until the next
    chunk)."""
    ws = ws or Workspace()
    (C, H, D), n = q.shape, keys.shape[1]
    a = torch.bmm(q, keys.transpose(1, 2), out=ws.get("a", (C, H, n), q.dtype, q.device)).mul_(D**-0.5)
    r, wh, s = _scores(a, w)
    terms, diff = kl_terms(s, mass, valid)
    if not grads:
        return ChunkGrads(terms)
    dw, da = _head_grads(r, wh, diff, scale, D, ws)
    dq = torch.bmm(da, keys, out=ws.get("dq", (C, H, D), q.dtype, q.device))
    dkeys = torch.bmm(da.transpose(1, 2), q, out=ws.get("dkeys", (C, n, D), q.dtype, q.device))
    return ChunkGrads(terms, dq, dw, dkeys)


def dense_chunk(q, w, keys, valid, mass, scale: float, grads: bool, per_row: int = 0,
                ws: Workspace | None = None) -> ChunkGrads:  # fmt: skip
    """Dense candidates: ``keys [N, D]`` (a pool range shared by the chunk's rows),
    ``valid``/``mass`` ``[C, N]``. ``per_row``: also return the pooled keys' terms per row,
    ``[C, N, D]`` in blocks of ``per_row`` rows, as ``dkeys`` (the exact mode's fixed-point
    sum needs them row by row); ``0``: ``dkeys [N, D]`` summed over the chunk."""
    ws = ws or Workspace()
    (C, H, D), N = q.shape, keys.shape[0]
    a = torch.mm(q.reshape(C * H, D), keys.t(), out=ws.get("a", (C * H, N), q.dtype, q.device))
    a = a.view(C, H, N).mul_(D**-0.5)
    r, wh, s = _scores(a, w)
    terms, diff = kl_terms(s, mass, valid)
    if not grads:
        return ChunkGrads(terms)
    dw, da = _head_grads(r, wh, diff, scale, D, ws)
    dq = torch.mm(da.reshape(C * H, N), keys, out=ws.get("dq", (C * H, D), q.dtype, q.device)).view(C, H, D)
    if per_row:
        return ChunkGrads(terms, dq, dw, (da, q))  # the caller walks blocks of rows (exact.row_terms)
    dkeys = torch.mm(da.reshape(C * H, N).t(), q.reshape(C * H, D), out=ws.get("dkeys", (N, D), q.dtype, q.device))
    return ChunkGrads(terms, dq, dw, dkeys)


def dense_row_terms(da: torch.Tensor, q: torch.Tensor, rows: slice) -> torch.Tensor:
    """The pooled keys' terms of the rows ``rows`` of a dense chunk, row by row:
    ``[b, N, D] = da[t]^T @ q[t]`` (``da`` with its ``D^-1/2``)."""
    return torch.bmm(da[rows].transpose(1, 2), q[rows])
