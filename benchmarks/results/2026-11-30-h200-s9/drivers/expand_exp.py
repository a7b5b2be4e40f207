"""Expansion experiment: the library's expand_pools (token of pool p gathered from
pool_tok_start) against a script-local variant that computes it from the row's metadata
(token(p) = row + 1 - tail_len - (pool_hi - p) * K: the pools a row selects lie in its own
document), on the rank-3 slice's shape with pools from its real selection."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import torch, triton, triton.language as tl
from bench_kernels import bench
from sp_kpool.kernels.triton_select import expand_pools, _pow2


@triton.jit
def expand_arith(P, stride_p, rows_ptr, tail_ptr, hi_ptr, Out, stride_o, k, topk, width,
                 K: tl.constexpr, KS: tl.constexpr, KP: tl.constexpr, TB: tl.constexpr, COMPACT: tl.constexpr):
    row = tl.program_id(0)
    pi = tl.arange(0, KP)
    p = tl.load(P + row.to(tl.int64) * stride_p + pi, mask=pi < k, other=-1)
    valid = p >= 0
    t = tl.load(rows_ptr + row).to(tl.int32)
    tlen = tl.load(tail_ptr + row).to(tl.int32)
    phi = tl.load(hi_ptr + row).to(tl.int32)
    first = (t + 1 - tlen) - (phi - p) * K
    slots = tl.arange(0, KS)
    orow = Out + tl.cast(row, tl.int64) * stride_o
    if COMPACT:
        tail0 = tl.sum(valid.to(tl.int32), axis=0) * K
    else:
        tail0 = topk
    cols = pi[:, None] * K + slots[None, :]
    j = cols - tail0
    val = tl.where(valid[:, None], first[:, None] + slots[None, :], tl.where((j >= 0) & (j < tlen), t - tlen + 1 + j, -1))
    tl.store(orow + cols, val, mask=(pi[:, None] < k) & (slots[None, :] < K))
    c = k * K + tl.arange(0, TB)
    j2 = c - tail0
    tl.store(orow + c, tl.where((j2 >= 0) & (j2 < tlen), t - tlen + 1 + j2, -1), mask=c < width)


def run_arith(pools, rows, tail_len, pool_hi, out, topk, kpool, tail, warps=4):
    R, k = pools.shape
    width = out.shape[1]
    expand_arith[(R,)](pools, pools.stride(0), rows, tail_len, pool_hi, out, out.stride(0), k, topk, width,
                       K=kpool, KS=_pow2(kpool), KP=_pow2(k), TB=_pow2(max(1, width - k * kpool)), COMPACT=tail == "compact",
                       num_warps=warps)
    return out


from sp_kpool.backends import BACKENDS
from sp_kpool.backends.base import select_rows, stage_tables
from sp_kpool.selection import row_meta
from sp_kpool.testing.problems import reference_slice_problem
p = reference_slice_problem(32, "fp8", total=131072, seed=32)
be = BACKENDS["deepgemm"]
lo, hi = p.seq.shard_start, p.seq.shard_end
st = stage_tables(be, p, lo, hi)
pooled = be.pool(p, st.pool_tok_start)
pools = select_rows(be, p, pooled, lo, hi, p.q, p.head_weights, st)
meta = row_meta(torch.arange(lo, hi, device="cuda"), st.cu, st.offs, 4)
pool_hi = meta.pool_hi.contiguous()
for width, tail in ((2051, "fixed"), (2051, "compact")):
    out = torch.empty((hi - lo, width), dtype=torch.int32, device="cuda")
    ref = expand_pools(pools, st.pool_tok_start, meta.rows, meta.tail_len, out.clone(), topk=2048, kpool=4, tail=tail)
    for warps in (4, 8):
        got = run_arith(pools, meta.rows, meta.tail_len, pool_hi, out.clone(), 2048, 4, tail, warps)
        print(f"width {width} {tail} warps {warps}: arith == gather {torch.equal(got, ref)}", flush=True)
    for rep in range(3):
        a = bench(lambda: expand_pools(pools, st.pool_tok_start, meta.rows, meta.tail_len, out, topk=2048, kpool=4, tail=tail), reps=20)
        b = bench(lambda: run_arith(pools, meta.rows, meta.tail_len, pool_hi, out, 2048, 4, tail), reps=20)
        c = bench(lambda: run_arith(pools, meta.rows, meta.tail_len, pool_hi, out, 2048, 4, tail, 8), reps=20)
        print(f"width {width} {tail} rep{rep}: gather {a*1e3:.1f} us arith {b*1e3:.1f} us arith8 {c*1e3:.1f} us", flush=True)
