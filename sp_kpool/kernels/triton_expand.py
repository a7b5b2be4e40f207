"""The expansion kernel (Triton): :func:`expand_pools` turns selected pools into token ids,
adds the tail and writes either column layout of :func:`sp_kpool.selection.assemble`.

Imports Triton: import this module only where Triton is available.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["expand_pools"]


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@triton.jit
def expand_kernel(P, stride_p, rows_ptr, tail_ptr, hi_ptr, Out, stride_o, k, topk, width,
                  K: tl.constexpr, KS: tl.constexpr, KP: tl.constexpr, TB: tl.constexpr, COMPACT: tl.constexpr):
    # one row per program; every column of the row is written once (no -1 fill beforehand):
    # columns [0, k K) as [k, K] (the tokens of pool slot i, else tail or -1), then the
    # columns [k K, width) (tail or -1). A visible pool p of the row starts at token
    # (t + 1 - tail) - (pool_hi - p) K: no table lookup (a gather per pool costs about a
    # third of the kernel's time)
    row = tl.program_id(0)
    pi = tl.arange(0, KP)
    p = tl.load(P + row.to(tl.int64) * stride_p + pi, mask=pi < k, other=-1)
    valid = p >= 0
    slots = tl.arange(0, KS)
    orow = Out + tl.cast(row, tl.int64) * stride_o
    t = tl.load(rows_ptr + row).to(tl.int32)
    tlen = tl.load(tail_ptr + row).to(tl.int32)
    phi = tl.load(hi_ptr + row).to(tl.int32)
    first = (t + 1 - tlen) - (phi - p) * K
    if COMPACT:  # the valid pools come first: the tail right after their tokens
        tail0 = tl.sum(valid.to(tl.int32), axis=0) * K
    else:
        tail0 = topk
    cols = pi[:, None] * K + slots[None, :]
    j = cols - tail0  # tail slot of each column
    val = tl.where(valid[:, None], first[:, None] + slots[None, :], tl.where((j >= 0) & (j < tlen), t - tlen + 1 + j, -1))
    tl.store(orow + cols, val, mask=(pi[:, None] < k) & (slots[None, :] < K))
    c = k * K + tl.arange(0, TB)
    j2 = c - tail0
    tl.store(orow + c, tl.where((j2 >= 0) & (j2 < tlen), t - tlen + 1 + j2, -1), mask=c < width)



def expand_pools(
    pools: torch.Tensor,
    rows: torch.Tensor,
    tail_len: torch.Tensor,
    pool_hi: torch.Tensor,
    out: torch.Tensor,
    *,
    topk: int,
    kpool: int,
    tail: str,
) -> torch.Tensor:
    """Token ids and tail into ``out`` (``[R, width]`` int32, unit column stride; every
    column is overwritten, nothing needs filling beforehand).

    ``pools``: ``[R, k]`` int32/int64 global pool ids, valid ones first, ``-1`` after (any
    order among the valid ones is kept), each a **visible** pool of its row (in
    ``[pool_lo, pool_hi)`` of :class:`sp_kpool.selection.RowMeta`, as every selector returns
    them); ``rows``, ``tail_len``, ``pool_hi``: ``[R]`` int64 (global token id, tail length
    and end of the visible pool range of each row). Pool ``p`` of row ``t`` starts at token
    ``t + 1 - tail_len - (pool_hi - p) * kpool`` (the pools before a row tile its document
    up to its tail). Writes the layout of :func:`sp_kpool.selection.assemble` and returns
    ``out``.
    """
    R, k = pools.shape
    if R == 0:
        return out
    if out.dim() != 2 or out.shape[0] != R or out.dtype != torch.int32 or (out.shape[1] > 1 and out.stride(1) != 1):
        raise ValueError(f"out: expected a [{R}, width] int32 tensor with unit column stride, got "
                         f"{out.dtype} {tuple(out.shape)} strides {tuple(out.stride())}")  # fmt: skip
    width = out.shape[1]
    pools = pools.contiguous()
    expand_kernel[(R,)](
        pools, pools.stride(0), rows.contiguous(), tail_len.contiguous(), pool_hi.contiguous(),
        out, out.stride(0), k, topk, width,
        K=kpool, KS=_pow2(kpool), KP=_pow2(k), TB=_pow2(max(1, width - k * kpool)), COMPACT=tail == "compact",
        num_warps=4,
    )  # fmt: skip
    return out
