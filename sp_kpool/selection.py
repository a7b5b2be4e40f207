"""Causal ranges, deterministic Top-K, expansion, tail, global ids and column layouts.

Causal rule (contract §4), for the query at document-local position ``j`` of a document whose
first pool has global id ``pool_lo``::

    visible pools   [pool_lo, pool_lo + (j + 1) // K)     (complete pools ending <= j)
    tail tokens     [t - (j + 1) % K + 1, t]              (ascending, includes t if any)

    K = 4, j = 6:   tokens  0 1 2 3 | 4 5 6
                    pools   [  0  ]   tail = 4 5 6

Everything here is index arithmetic on tensors; it runs on CPU and CUDA with no per-row
host synchronisation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import _device
from ._device import to_device
from ._probe import probe
from .config import ORDERS, TAILS, output_width

__all__ = [
    "RowMeta",
    "row_meta",
    "output_width",
    "score_keys",
    "topk_pools",
    "topk_pools_fast",
    "select_pools",
    "topk_pools_radix",
    "serving_pools",
    "assemble",
    "TAILS",
    "ORDERS",
]


# Key of a masked-out (invisible) pool: below every real key, so it sorts last.
_INVALID_KEY = torch.iinfo(torch.int64).min


@dataclass(frozen=True)
class RowMeta:
    """Per-row causal metadata for ``R`` global rows (all tensors ``[R]``, int64).

    rows: global token id ``t``; pool_lo: global id of the document's first pool;
    n_visible: ``(j + 1) // K`` complete visible pools; tail_len: ``(j + 1) % K``;
    padding: bool, rows of the padding document (their output is all ``-1``).
    """

    rows: torch.Tensor
    pool_lo: torch.Tensor
    n_visible: torch.Tensor
    tail_len: torch.Tensor
    padding: torch.Tensor

    @functools.cached_property
    def pool_hi(self) -> torch.Tensor:
        """End (exclusive) of the visible pool range, ``pool_lo + n_visible`` (computed once
        per object: the plan keeps its rows' metadata across calls)."""
        return self.pool_lo + self.n_visible


def row_meta(
    rows: torch.Tensor, real_cu_seq_lens: torch.Tensor, doc_pool_offset: torch.Tensor, kpool: int
) -> RowMeta:
    """Causal metadata of the global ``rows`` (``[R]`` int64) of a packed sequence.

    ``real_cu_seq_lens`` (``[num_docs + 1]``) and ``doc_pool_offset`` (from
    :func:`sp_kpool.pooling.pool_table`) describe real documents only; rows at or past
    ``real_cu_seq_lens[-1]`` are padding. Tables on the host are copied without blocking
    (:func:`sp_kpool._device.to_device`); in loops pass them already on the device.
    """
    device = rows.device
    cu = to_device(real_cu_seq_lens, device)
    offs = to_device(doc_pool_offset, device)
    num_real = cu[-1]
    padding = rows >= num_real
    safe = torch.where(padding, torch.zeros_like(rows), rows)
    doc = torch.searchsorted(cu, safe, right=True) - 1
    j = safe - cu[doc]
    n_visible = torch.where(padding, torch.zeros_like(j), (j + 1) // kpool)
    tail_len = torch.where(padding, torch.zeros_like(j), (j + 1) % kpool)
    return RowMeta(rows=rows, pool_lo=offs[doc], n_visible=n_visible, tail_len=tail_len, padding=padding)


def _pack_keys(values: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """int64 ``(value, -column)`` keys: the FP32 bits of ``value + 0.0`` (``-0.0`` folds into
    ``+0.0``) mapped to a monotone int32 in the high word, ``0xFFFFFFFF - column`` in the low."""
    bits = (values.float() + 0.0).view(torch.int32).to(torch.int64)
    return (torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) << 32) | (0xFFFFFFFF - cols)


def _unpack_ids(keys: torch.Tensor, col0) -> torch.Tensor:
    """Global ids ``col0 + column`` of keys made by :func:`_pack_keys`."""
    return (0xFFFFFFFF - (keys & 0xFFFFFFFF)) + col0


def score_keys(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Totally ordered int64 keys: higher score first, ties toward the lower column.

    ``scores``: ``[R, N]`` float32; ``visible``: ``[R, N]`` bool. The FP32 bit pattern is
    mapped to a monotone int32 (``-0.0`` is first folded into ``+0.0`` so they tie), shifted
    into the high word, and the low word holds ``0xFFFFFFFF - column``. Every key in a row is
    distinct, so any Top-K over them (``torch.topk`` on CPU or CUDA) is deterministic.
    Invisible entries and NaN scores get the minimum int64 (NaN is never selected, on any
    path).
    """
    n = scores.shape[-1]
    if n >= 2**32:
        raise ValueError(f"scores: at most 2**32 columns supported, got {n}")
    keys = _pack_keys(scores, torch.arange(n, device=scores.device, dtype=torch.int64))
    return keys.masked_fill_(~visible | torch.isnan(scores), _INVALID_KEY)


def topk_pools(
    scores: torch.Tensor, visible: torch.Tensor, k: int, col0: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select ``min(k, visible count)`` pools per row, best first, ties toward lower id.

    Args:
        scores: ``[R, N]`` float32 scores of pools ``col0 .. col0 + N - 1``.
        visible: ``[R, N]`` bool.
        k: number of pools to select (``topk // kpool``).
        col0: global pool id of column 0.

    Returns:
        pools: ``[R, min(k, N)]`` int64 global pool ids in score order, ``-1`` where unused
        (unused entries always come last).
        valid: ``[R, min(k, N)]`` bool.
    """
    kk = min(k, scores.shape[-1])
    keys = score_keys(scores, visible)
    top = torch.topk(keys, kk, dim=-1, sorted=True).values
    valid = top != _INVALID_KEY
    return _unpack_ids(top, col0).masked_fill_(~valid, -1), valid


#: Extra candidates taken by :func:`topk_pools_fast` beyond ``k`` to settle boundary ties.
FAST_EXTRA = 8


def topk_pools_fast(scores: torch.Tensor, k: int, col0: int, extra: int = FAST_EXTRA):
    """The same selection as :func:`topk_pools`, from an FP32 Top-K plus a small int64 one.

    ``scores``: ``[R, N]`` float32 with ``-inf`` at invisible cells (visible scores are
    finite). ``torch.topk`` takes ``k + extra`` candidates by value; when the ``k``-th
    value is strictly above the last candidate's, every pool that the exact rule could pick
    is a candidate, and ranking the candidates by :func:`score_keys` gives exactly the
    exact answer. Otherwise (a tie run longer than ``extra`` at the boundary; one host
    synchronisation per call to find out) the exact int64 Top-K runs on the whole block.
    Returns ``(pools, valid)`` as :func:`topk_pools`.
    """
    n = scores.shape[-1]
    kk = min(k, n)
    kc = min(kk + extra, n)
    if kc == n:
        return topk_pools(scores, scores > -float("inf"), k, col0)
    vals, idx = torch.topk(scores, kc, dim=-1, sorted=True)
    boundary = vals[:, kk - 1]
    ambiguous = (boundary == vals[:, kc - 1]) & (boundary > -float("inf"))
    if bool(ambiguous.any()):
        return topk_pools(scores, scores > -float("inf"), k, col0)
    # rank candidates exactly: keys of (value, column) on the [R, kc] candidate block
    keys = _pack_keys(vals, idx).masked_fill_(~(vals > -float("inf")), _INVALID_KEY)
    top = torch.topk(keys, kk, dim=-1, sorted=True).values
    valid = top != _INVALID_KEY
    return _unpack_ids(top, col0).masked_fill_(~valid, -1), valid


def topk_pools_radix(scores: torch.Tensor, ends: torch.Tensor, k: int, col0, selector, ordered: bool = True):
    """The same selection as :func:`topk_pools`, from LMDeploy's radix selector plus a check.

    ``scores``: ``[R, N]`` float32, ``-inf`` at invisible cells, row ``r`` visible only
    inside ``[0, ends[r])``; ``selector`` is ``sparse_index_topk`` (``k`` in {512, 2048}).
    The selector returns *a* top-``k`` set in no particular order; it is the exact set
    unless values equal to the row's threshold (its ``k``-th best) were left out, which one
    pass over the scores detects. Such rows (one host synchronisation per call to find
    them) are redone with :func:`topk_pools_fast`. With ``ordered`` the set is ranked by
    :func:`score_keys` (score order); without, the ids come in no fixed order with ``-1``
    anywhere (for callers that sort by pool id anyway). Returns ``(pools, valid)``.
    """
    R, n = scores.shape
    if n <= k:
        return topk_pools_fast(scores, k, col0)
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    ends32 = ends.to(torch.int32).contiguous()
    ones = torch.ones(R, dtype=torch.int32, device=scores.device)
    idx = selector(scores, ones, ends32, k).long()  # [R, k], -1 fill
    present = idx >= 0
    vals = scores.gather(1, idx.clamp(min=0)).masked_fill_(~present, -float("inf"))
    valid = vals > -float("inf")
    thr = torch.where(valid, vals, float("inf")).amin(1, keepdim=True)
    full = valid.sum(1) == k
    eq_all = (scores == thr).sum(1)
    eq_sel = (valid & (vals == thr)).sum(1)
    if ordered:
        keys = _pack_keys(vals, idx.clamp(min=0)).masked_fill_(~valid, _INVALID_KEY)
        top = torch.sort(keys, dim=-1, descending=True).values
        ok = top != _INVALID_KEY
        pools = _unpack_ids(top, col0)
    else:  # the set in the selector's order; -1 may sit anywhere
        ok = valid
        pools = idx + col0
    pools = pools.masked_fill_(~ok, -1)
    redo = torch.nonzero(full & (eq_all > eq_sel)).flatten()
    if redo.numel():  # exact ties at the threshold: settle those rows by the exact rule
        c0 = col0 if not isinstance(col0, torch.Tensor) else col0[redo]
        fixed, fixed_ok = topk_pools_fast(scores[redo], k, c0)
        pools[redo], ok[redo] = fixed, fixed_ok
    return pools, ok


def _radix_selector(k: int):
    """LMDeploy's ``sparse_index_topk`` if importable and ``k`` is one of its sizes."""
    if k not in (512, 2048):
        return None
    mod, _ = probe("lmdeploy.pytorch.kernels.cuda.sparse_index_topk")
    return getattr(mod, "sparse_index_topk", None) if mod is not None else None


def serving_pools(scores: torch.Tensor, ends: torch.Tensor, k: int, col0, selector) -> torch.Tensor:
    """``order="serving"``: exactly what the serving selector returns, in its order.

    LMDeploy's ``sparse_index_topk`` over each row's columns ``[0, ends[r])`` (``-inf`` at
    invisible cells, which are dropped). Its set matches the exact rule except at exact
    ties at the threshold, and its order comes from atomics: **not deterministic** between
    calls. Use it only where parity with the rollout engine is the point.
    """
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    R = scores.shape[0]
    ones = torch.ones(R, dtype=torch.int32, device=scores.device)
    idx = selector(scores, ones, ends.to(torch.int32).contiguous(), k).long()
    ok = idx >= 0
    ok &= scores.gather(1, idx.clamp(min=0)) > -float("inf")
    # keep the selector's order among the kept ids; dropped ones move to the end
    order = torch.sort((~ok).to(torch.int8), dim=-1, stable=True).indices
    pools = torch.gather(idx + col0, 1, order)
    return pools.masked_fill_(~torch.gather(ok, 1, order), -1)


def _triton_select(k: int, width: int):
    """:func:`sp_kpool.kernels.triton_topk.topk_ascending` if Triton imports and ``k`` and
    the row ``width`` are within its limits (:func:`sp_kpool.kernels.triton_topk.supports`)."""
    if probe("triton")[0] is None:
        return None
    from .kernels.triton_topk import supports, topk_ascending

    return topk_ascending if supports(width, k) else None


def reads_row_ranges_only(k: int, width: int, order: str) -> bool:
    """Whether :func:`select_pools` on CUDA selects ``k`` of ``width`` columns with the
    Triton selector, which reads only ``[start, end)`` of each row: scorers may then leave
    the other cells unwritten (no ``-inf`` pass). The one place that decides it, for the
    selector and the scorers alike."""
    return order != "serving" and _triton_select(k, width) is not None


def _ascending(pools: torch.Tensor) -> torch.Tensor:
    """``pools`` (``-1`` unused) sorted ascending, the ``-1`` last."""
    big = torch.iinfo(pools.dtype).max
    p = torch.sort(pools.masked_fill(pools < 0, big), dim=-1).values
    return p.masked_fill_(p == big, -1)


def _rank_by_score(scores: torch.Tensor, pools: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """The selected ``pools`` (global ids, ``-1`` unused) of each row in score order."""
    valid = pools >= 0
    idx = torch.where(valid, pools.long() - base, 0)
    keys = _pack_keys(scores.gather(1, idx), idx).masked_fill_(~valid, _INVALID_KEY)
    top = torch.sort(keys, dim=-1, descending=True).values
    return _unpack_ids(top, base).masked_fill_(top == _INVALID_KEY, -1)


def select_pools(
    scores, visible, k: int, col0, ends=None, order: str = "", starts=None, out=None
) -> torch.Tensor:
    """Deterministic Top-K of one scoring chunk: ``[R, min(k, N)]`` global pool ids, ``-1``.

    ``scores``: ``[R, N]`` float32 for pools ``col0 + column`` (``col0`` an int or ``[R, 1]``
    int64); ``visible``: ``[R, N]`` bool, or ``None`` when ``scores`` already holds ``-inf``
    at invisible cells; ``starts``/``ends``: ``[R]`` the columns that may be visible
    (optional; cells outside are ignored).

    Order of each row: ``order="ascending"``: ascending pool id; ``"serving"``: the serving
    selector's; otherwise score order. On CUDA the Triton selector of :mod:`sp_kpool.kernels.triton_topk` (exact by
    construction, no host synchronisation), else LMDeploy's radix selector with an
    exactness check, else the FP32 candidate path; on CPU the int64-key path. All return
    the same sets.

    ``out``: optional ``[R, k]`` int32 destination (unit column stride, e.g. rows of the
    pipeline's output): the row is written whole, ``-1`` past ``min(k, N)``, and ``out`` is
    returned. The Triton selector writes into it directly; the other paths copy.
    """
    if out is not None:
        R = scores.shape[0]
        if out.shape != (R, k) or out.dtype != torch.int32 or out.device != scores.device:
            raise ValueError(f"out: expected an int32 tensor of shape {(R, k)} on {scores.device}, got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")  # fmt: skip
        if _device.on_gpu(scores.device) and order == "ascending" and reads_row_ranges_only(k, scores.shape[1], order):
            return _select_cuda(scores, visible, k, col0, ends, order, starts, out)
        pools = select_pools(scores, visible, k, col0, ends, order, starts)
        out[:, : pools.shape[1]] = pools
        out[:, pools.shape[1] :] = -1
        return out
    if order == "serving":
        selector = _radix_selector(k) if _device.on_gpu(scores.device) else None
        if selector is None or ends is None:
            raise ValueError(f"order: 'serving' needs CUDA, lmdeploy and k in (512, 2048) pools, got k = {k} on {scores.device}")
        if visible is not None:
            scores = scores.masked_fill(~visible, -float("inf"))
        return serving_pools(scores, ends, k, col0, selector)
    R, n = scores.shape
    if _device.on_gpu(scores.device):
        if reads_row_ranges_only(k, n, order):
            return _select_cuda(scores, visible, k, col0, ends, order, starts, None)
        if visible is not None:
            scores = scores.masked_fill(~visible, -float("inf"))
        scores = torch.where(torch.isnan(scores), -float("inf"), scores)  # NaN: never selected
        selector = _radix_selector(k) if ends is not None else None
        if selector is not None:
            pools = topk_pools_radix(scores, ends, k, col0, selector, ordered=order != "ascending")[0]
        else:
            pools = topk_pools_fast(scores, k, col0)[0]
    else:
        if visible is None:
            visible = scores > -float("inf")
        pools = topk_pools(scores, visible, k, col0)[0]
    return _ascending(pools) if order == "ascending" else pools


def _select_cuda(scores, visible, k: int, col0, ends, order: str, starts, out):
    """The Triton selector's path of :func:`select_pools` (``out``: ``[R, k]`` or ``None``)."""
    from .kernels.triton_topk import topk_ascending as fast

    R, n = scores.shape
    dev = scores.device
    if visible is not None:
        scores = scores.masked_fill(~visible, -float("inf"))
    base = col0.reshape(R) if isinstance(col0, torch.Tensor) else torch.full((R,), int(col0), device=dev)
    lo = starts if starts is not None else torch.zeros(R, dtype=torch.int32, device=dev)
    hi = ends if ends is not None else torch.full((R,), n, dtype=torch.int32, device=dev)
    pools = fast(scores, lo, hi, base.to(torch.int64), k, out=out)
    if out is not None:  # order "ascending": the kernel wrote -1 past min(k, visible) <= min(k, n)
        return out
    pools = pools[:, : min(k, n)]
    return pools if order == "ascending" else _rank_by_score(scores, pools, base.reshape(R, 1))


def assemble(
    pools: torch.Tensor,
    meta: RowMeta,
    pool_tok_start: torch.Tensor,
    *,
    topk: int,
    kpool: int,
    tail: str,
    order: str,
    alignment: int,
    presorted: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expand selected pools to token ids, add the tail, lay out the columns.

    Args:
        pools: ``[R, k_sel]`` int64 global pool ids in score order, ``-1`` unused (last);
            each a visible pool of its row (``[meta.pool_lo, meta.pool_hi)``, as the
            selectors return them: the CUDA path computes the token ids from the row's
            metadata, the CPU path reads ``pool_tok_start``).
        meta: causal metadata of the ``R`` rows (real rows: a padding row must come with
            no pools; its tail is empty, so its output is all ``-1``).
        pool_tok_start: ``[P]`` int64, first token of each pool (same device as ``pools``).
        topk, kpool, tail, order, alignment: see :func:`sp_kpool.kpool_topk`.
        presorted: ``pools`` are already in ascending order (as :func:`select_pools`
            returns them for ``order="ascending"``); skips the sort.
        out: optional ``[R, width]`` int32 destination, overwritten entirely (saves a copy).

    Returns:
        ``[R, align(topk + kpool - 1, alignment)]`` int32 global token ids, ``-1`` padded.
        ``fixed``: history in ``[0, topk)``, tail in ``[topk, topk + kpool - 1)``;
        ``compact``: history, then the tail right after it, then ``-1``.
    """
    device = pools.device
    rows, k_sel = pools.shape
    width = output_width(topk, kpool, alignment)
    dest, out = out, None
    if dest is not None and (dest.shape != (rows, width) or dest.dtype != torch.int32):
        raise ValueError(f"out: expected an int32 tensor of shape {(rows, width)}, got {dest.dtype} {tuple(dest.shape)}")
    p32 = pools.to(torch.int32)
    if order == "ascending" and not presorted:
        p32 = _ascending(p32)
    if _device.on_gpu(device) and probe("triton")[0] is not None:
        from .kernels.triton_expand import expand_pools

        # the kernel writes every column (no -1 fill first)
        dest = dest if dest is not None else torch.empty((rows, width), dtype=torch.int32, device=device)
        return expand_pools(
            p32, meta.rows, meta.tail_len, meta.pool_hi, dest, topk=topk, kpool=kpool, tail=tail
        )  # fmt: skip
    valid = p32 >= 0
    num_pools = pool_tok_start.numel()
    ext = torch.cat([pool_tok_start.to(torch.int32), pool_tok_start.new_full((1,), -kpool, dtype=torch.int32)])
    first = ext.index_select(0, torch.where(valid, p32, num_pools).flatten()).view(rows, k_sel, 1)
    slots = torch.arange(kpool, device=device, dtype=torch.int32)
    hist = (first + slots).view(rows, k_sel * kpool)  # unused pools: -K + slot < 0
    hist = hist.clamp_(min=-1)
    out = torch.full((rows, width), -1, dtype=torch.int32, device=device)
    out[:, : k_sel * kpool] = hist
    if kpool > 1:
        toff = torch.arange(kpool - 1, device=device)
        tail_len = meta.tail_len[:, None]
        tail_ids = (meta.rows[:, None] - tail_len + 1 + toff).to(torch.int32)
        tail_ok = toff[None] < tail_len
        tail_ids = tail_ids.masked_fill_(~tail_ok, -1)
        if tail == "fixed":
            out[:, topk : topk + kpool - 1] = tail_ids
        else:
            n_hist = valid.sum(-1, keepdim=True) * kpool
            col = torch.where(tail_ok, n_hist + toff[None], width)  # dump column past the end
            wide = torch.cat([out, out.new_full((rows, 1), -1)], dim=1)
            wide.scatter_(1, col, tail_ids)
            out = wide[:, :width]
    return dest.copy_(out) if dest is not None else out
