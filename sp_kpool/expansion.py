"""Expansion: selected pools to token ids, the tail, and the column layouts (contract §4, §5).

:func:`assemble` turns a row's selected pool ids into its ``K`` token ids each, adds the
tail of the current incomplete pool and lays the columns out (``tail="fixed"`` or
``"compact"``, ``alignment``); on CUDA the Triton kernel of
:mod:`sp_kpool.kernels.triton_expand` writes every column in one launch.
"""

from __future__ import annotations

import torch

from . import _device
from ._probe import probe
from .config import UNUSED_FIRST, output_width
from .topk_rule import _ascending

__all__ = ["assemble"]


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
        ``compact``: history, then the tail right after it, then ``-1``. History order:
        ``pools``' order (sorted first for ``ascending``), the unused slots last; with
        ``order="ascending-unused-first"`` (``fixed`` only) the ``topk // kpool - n`` unused
        slots first, then the ``n`` selected pools ascending (XTuner's canonical columns).
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
    elif order == UNUSED_FIRST:
        if tail != "fixed":
            raise ValueError(f"tail: order {UNUSED_FIRST!r} needs tail='fixed', got {tail!r}")
        # ascending with -1 (below every id) first, left-padded to topk // kpool slots; the
        # Triton expansion (tail="fixed") expands every slot on its own, -1 anywhere
        p32 = torch.sort(p32, dim=-1).values
        if k_sel < topk // kpool:
            p32 = torch.cat([p32.new_full((rows, topk // kpool - k_sel), -1), p32], dim=1)
        k_sel = topk // kpool
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
    # the history written in place (two passes over the output, no temporary of its size)
    out = torch.empty((rows, width), dtype=torch.int32, device=device)
    hist = out[:, : k_sel * kpool].view(rows, k_sel, kpool)
    torch.add(first, slots, out=hist).clamp_(min=-1)  # unused pools: -K + slot < 0
    out[:, k_sel * kpool :].fill_(-1)
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
