"""The exact Top-K rule of contract §4 and its implementations: higher score first, ties
toward the lower pool id, ``-0.0`` equal to ``+0.0``, NaN never selected.

Every function here returns the same set for the same scores; they differ in where they
run and how fast: :func:`topk_pools` (exact int64 ``(score, -column)`` keys and
``torch.topk``, any device: the reference), :func:`topk_pools_fast` (an FP32 ``torch.topk``
of ``k + 8`` candidates plus a tie check), :func:`topk_pools_radix` (LMDeploy's
``sparse_index_topk`` plus an exactness check), :func:`serving_pools` (``order="serving"``:
LMDeploy's set in its order) and the Triton selector's path (``_select_cuda``,
:mod:`sp_kpool.kernels.triton_topk`). The registered selectors that wrap them, and the
registry that chooses among them, are in :mod:`sp_kpool.selectors` (which also gives every
name of this module).
"""

from __future__ import annotations

import torch

from ._probe import probe

__all__ = ["score_keys", "topk_pools", "topk_pools_fast", "topk_pools_radix", "serving_pools", "FAST_EXTRA"]


# Key of a masked-out (invisible) pool: below every real key, so it sorts last.
_INVALID_KEY = torch.iinfo(torch.int64).min



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


def _select_cuda(scores, visible, k: int, col0, ends, order: str, starts, out, short_rows: bool | str = True):
    """The Triton selector's path of :func:`select_pools` (``out``: ``[R, k]`` or ``None``)."""
    from .kernels.triton_topk import topk_ascending as fast

    R, n = scores.shape
    dev = scores.device
    if visible is not None:
        scores = scores.masked_fill(~visible, -float("inf"))
    base = col0.reshape(R) if isinstance(col0, torch.Tensor) else torch.full((R,), int(col0), device=dev)
    lo = starts if starts is not None else torch.zeros(R, dtype=torch.int32, device=dev)
    hi = ends if ends is not None else torch.full((R,), n, dtype=torch.int32, device=dev)
    pools = fast(scores, lo, hi, base.to(torch.int64), k, out=out, short_rows=short_rows)
    if out is not None:  # order "ascending": the kernel wrote -1 past min(k, visible) <= min(k, n)
        return out
    pools = pools[:, : min(k, n)]
    return pools if order == "ascending" else _rank_by_score(scores, pools, base.reshape(R, 1))


def _mask(scores, visible):
    """``scores`` with ``-inf`` at invisible cells and NaN (never selected)."""
    if visible is not None:
        scores = scores.masked_fill(~visible, -float("inf"))
    return torch.where(torch.isnan(scores), -float("inf"), scores)

