"""The chunk row-range kernel (Triton): :func:`chunk_row_ranges`, every row's ``[start,
end)`` relative to its chunk's pool range, in one launch.

Imports Triton: import this module only where Triton is available.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["chunk_row_ranges"]


# integer arguments not specialised (divisibility, == 1): they change with the rank and the
# call, and a new specialisation is a compile on the host's path
@triton.jit(do_not_specialize=["n_docs", "lo_row", "hi_row", "first", "C", "total"])
def ranges_kernel(cu_ptr, offs_ptr, bounds_ptr, out_ptr, n_docs, lo_row, hi_row, first, C, total,
                  K: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = i < total
    g = first + i  # global row
    mine = inb & (g >= lo_row) & (g < hi_row)
    # document of g: the last d in [0, n_docs) with cu[d] <= g (binary search)
    d_lo = tl.zeros((BLOCK,), tl.int32)
    d_hi = tl.zeros((BLOCK,), tl.int32) + (n_docs - 1)
    for _ in tl.static_range(STEPS):
        mid = (d_lo + d_hi + 1) // 2
        c = tl.load(cu_ptr + mid, mask=mine, other=0)
        up = c <= g
        d_lo = tl.where(up, mid, d_lo)
        d_hi = tl.where(up, d_hi, mid - 1)
    cu_d = tl.load(cu_ptr + d_lo, mask=mine, other=0)
    p_lo = tl.load(offs_ptr + d_lo, mask=mine, other=0)
    p_hi = p_lo + (g - cu_d + 1) // K
    ch = i // C
    c_lo = tl.load(bounds_ptr + 2 * ch, mask=mine, other=0)
    c_hi = tl.load(bounds_ptr + 2 * ch + 1, mask=mine, other=0)
    r_s = tl.maximum(p_lo - c_lo, 0)
    r_e = tl.maximum(tl.minimum(p_hi, c_hi) - c_lo, r_s)
    tl.store(out_ptr + i, tl.where(mine, r_s, 0).to(tl.int32), mask=inb)
    tl.store(out_ptr + total + i, tl.where(mine, r_e, 0).to(tl.int32), mask=inb)


def chunk_row_ranges(cu: torch.Tensor, offs: torch.Tensor, bounds: torch.Tensor, lo_row: int, hi_row: int,
                     first: int, C: int, kpool: int) -> torch.Tensor:  # fmt: skip
    """``[2, n_chunks * C]`` int32: ``[start, end)`` of every row of the chunk grid (global
    row ``first + i``) relative to its chunk's pool range ``bounds[i // C]`` (``[n_chunks,
    2]`` int64), ``0, 0`` for rows outside ``[lo_row, hi_row)`` (real rows only). ``cu``:
    ``real_cu_seq_lens`` (int64, ``[docs + 1]``), ``offs``: ``doc_pool_offset``. Equal to
    :func:`sp_kpool.backends.base.row_ranges_torch` (one launch instead of about thirty
    small kernels on the host's path to the first scoring call). The binary search over
    the documents takes ``bit_length(docs)`` steps, rounded up to a multiple of 4 (few
    compiled variants)."""
    total = bounds.shape[0] * C
    out = torch.empty((2, total), dtype=torch.int32, device=bounds.device)
    n_docs = cu.numel() - 1
    if total:
        block = 1024
        ranges_kernel[(triton.cdiv(total, block),)](
            cu, offs, bounds, out, n_docs, lo_row, hi_row, first, C, total,
            K=kpool, STEPS=-(-max(1, n_docs.bit_length()) // 4) * 4, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out
