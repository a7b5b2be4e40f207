"""Triton kernels of the serving arithmetic (contract §6), bitwise equal to :mod:`sp_kpool.serving`.

* :func:`pools_serving`: serving's compression (FP32, slots in order: the decode order's two
  passes, or per pool the extend order's online recurrence where ``extend`` says so), then
  either BF16 storage (``bf16-serving``) or BF16 round -> Hadamard -> BF16 round -> E4M3
  with a UE8M0 scale per pool (``fp8``), in one kernel.
* :func:`queries_fp8`: Hadamard -> BF16 round -> E4M3 with a scale per (row, head).
* :func:`prepare_fp8`: both of the FP8 ones in one launch (the same kernel code).
* :func:`pools_model` (:mod:`sp_kpool.kernels.triton_model_pools`, importable from here): the
  model-definition pools (``bf16``, contract §2) in one launch, bitwise equal to
  :func:`sp_kpool.pooling.compress_pools_bf16` on the GPU (about a dozen torch kernels).

Exactness: products and sums that torch runs as separate kernels are written as PTX
``mul.rn.f32`` / ``add.rn.f32`` (never contracted into an FMA;
:mod:`sp_kpool.kernels.triton_rounding`), divisions as
``div_rn``, ``exp`` as libdevice's ``expf`` (the same as torch's CUDA ``exp``).
"""

from __future__ import annotations

import functools

import torch

from .triton_model_pools import pools_model, pools_model_supports

__all__ = ["pools_serving", "pools_model", "pools_model_supports", "queries_fp8", "prepare_fp8"]


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from .triton_rounding import add_rn, mul_rn

    @triton.jit
    def butterfly(x, BLOCK: tl.constexpr, D: tl.constexpr, H: tl.constexpr):
        # pairs (x[j], x[j + H]) with j mod 2H < H become (a + b, a - b)
        y = tl.reshape(x, (BLOCK, D // (2 * H), 2, H))
        y = tl.permute(y, (0, 1, 3, 2))
        a, b = tl.split(y)
        y = tl.join(add_rn(a, b), add_rn(a, -b))
        y = tl.permute(y, (0, 1, 3, 2))
        return tl.reshape(y, (BLOCK, D))

    @triton.jit
    def butterflies(x, BLOCK: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr):
        # butterfly stages h = 1, 2, 4, ..., D / 2 along the last dim
        for st in tl.static_range(LOG2D):
            x = butterfly(x, BLOCK, D, 1 << st)
        return x

    @triton.jit
    def hadamard(x, BLOCK: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr, INV_SQRT_D):
        # butterfly stages, then * D^-0.5 (`tl` in the body: the annotations resolve through
        # this function's closure)
        y = butterflies(x, BLOCK, D, LOG2D)
        return mul_rn(y, tl.full((), INV_SQRT_D, tl.float32))

    @triton.jit
    def quantize(x, out_ptr, scale_ptr, rows, rmask, cols, D: tl.constexpr):
        amax = tl.max(tl.abs(x), axis=1)
        s = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
        bits = s.to(tl.int32, bitcast=True)
        scale = ((bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
        v = tl.math.div_rn(x, scale[:, None])
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        tl.store(out_ptr + rows[:, None] * D + cols[None, :], v.to(tl.float8e4nv), mask=rmask[:, None])
        tl.store(scale_ptr + rows, scale, mask=rmask)

    @triton.jit
    def pool_kernel(k_ptr, g_ptr, ape_ptr, start_ptr, ext_ptr, out_ptr, scale_ptr, P, stride_k, stride_g, INV_SQRT_D,
                    K: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr,
                    EXT: tl.constexpr):
        pool_program(tl.program_id(0), k_ptr, g_ptr, ape_ptr, start_ptr, ext_ptr, out_ptr, scale_ptr, P, stride_k,
                     stride_g, INV_SQRT_D, K, D, LOG2D, BLOCK, FP8, EXT)  # fmt: skip

    @triton.jit
    def pool_program(pid, k_ptr, g_ptr, ape_ptr, start_ptr, ext_ptr, out_ptr, scale_ptr, P, stride_k, stride_g,
                     INV_SQRT_D, K: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr, BLOCK: tl.constexpr,
                     FP8: tl.constexpr, EXT: tl.constexpr):
        # pools pid * BLOCK .. pid * BLOCK + BLOCK - 1; with EXT, ext_ptr [P] (uint8) marks the
        # pools compressed in extend order (the online recurrence, computed alongside)
        rows = pid * BLOCK + tl.arange(0, BLOCK)
        rmask = rows < P
        cols = tl.arange(0, D)
        base = tl.load(start_ptr + rows, mask=rmask, other=0).to(tl.int64)
        m = tl.full((BLOCK, D), float("-inf"), tl.float32)
        for j in tl.static_range(K):
            g = tl.load(g_ptr + (base + j)[:, None] * stride_g + cols[None, :], mask=rmask[:, None], other=0.0)
            a = tl.load(ape_ptr + j * D + cols)
            m = tl.maximum(m, add_rn(g.to(tl.float32), a.to(tl.float32)[None, :]))
        den = tl.zeros((BLOCK, D), tl.float32)
        num = tl.zeros((BLOCK, D), tl.float32)
        if EXT:  # the extend order: m' = max(m, s), r = exp(m - m'), p = exp(s - m'), ...
            em = tl.full((BLOCK, D), float("-inf"), tl.float32)
            eden = tl.zeros((BLOCK, D), tl.float32)
            eacc = tl.zeros((BLOCK, D), tl.float32)
        for j in tl.static_range(K):
            g = tl.load(g_ptr + (base + j)[:, None] * stride_g + cols[None, :], mask=rmask[:, None], other=0.0)
            a = tl.load(ape_ptr + j * D + cols)
            s = add_rn(g.to(tl.float32), a.to(tl.float32)[None, :])
            e = libdevice.exp(add_rn(s, -m))
            den = add_rn(den, e)
            kv = tl.load(k_ptr + (base + j)[:, None] * stride_k + cols[None, :], mask=rmask[:, None], other=0.0)
            num = add_rn(num, mul_rn(kv.to(tl.float32), e))
            if EXT:
                m2 = tl.maximum(em, s)
                r = libdevice.exp(add_rn(em, -m2))
                p = libdevice.exp(add_rn(s, -m2))
                eden = add_rn(mul_rn(eden, r), p)
                eacc = add_rn(mul_rn(eacc, r), mul_rn(kv.to(tl.float32), p))
                em = m2
        pooled = tl.math.div_rn(num, den)
        if EXT:
            ext = tl.load(ext_ptr + rows, mask=rmask, other=0)
            pooled = tl.where((ext != 0)[:, None], tl.math.div_rn(eacc, eden), pooled)
        if FP8:
            x = pooled.to(tl.bfloat16).to(tl.float32)
            x = hadamard(x, BLOCK, D, LOG2D, INV_SQRT_D)
            x = x.to(tl.bfloat16).to(tl.float32)
            quantize(x, out_ptr, scale_ptr, rows, rmask, cols, D)
        else:
            tl.store(out_ptr + rows[:, None] * D + cols[None, :], pooled.to(tl.bfloat16), mask=rmask[:, None])

    @triton.jit
    def query_kernel(q_ptr, out_ptr, scale_ptr, NR, INV_SQRT_D,
                     D: tl.constexpr, LOG2D: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK + tl.arange(0, BLOCK)
        rmask = rows < NR
        cols = tl.arange(0, D)
        x = tl.load(q_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], mask=rmask[:, None], other=0.0)
        x = hadamard(x.to(tl.float32), BLOCK, D, LOG2D, INV_SQRT_D)
        x = x.to(tl.bfloat16).to(tl.float32)
        quantize(x, out_ptr, scale_ptr, rows.to(tl.int64), rmask, cols, D)

    @triton.jit
    def bfly(a, b):
        return add_rn(a, b), add_rn(a, -b)

    @triton.jit
    def quant8(v, inv_scale):
        # v * (1 / scale) == v / scale: the scale is a power of two, its inverse exact
        v = mul_rn(v, inv_scale[:, None])
        return tl.minimum(tl.maximum(v, -448.0), 448.0).to(tl.float8e4nv)

    @triton.jit
    def join16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, BLOCK: tl.constexpr):
        # the 16 slices [BLOCK, 8] (x_m: channels 8m .. 8m + 7) as one [BLOCK, 128] tensor in
        # channel order (joins add a minor dim per bit of m, lowest bit first)
        a = tl.join(tl.join(tl.join(tl.join(x0, x1), tl.join(x2, x3)), tl.join(tl.join(x4, x5), tl.join(x6, x7))),
                    tl.join(tl.join(tl.join(x8, x9), tl.join(x10, x11)), tl.join(tl.join(x12, x13), tl.join(x14, x15))))
        return tl.reshape(tl.permute(a, (0, 5, 4, 3, 2, 1)), (BLOCK, 128))

    @triton.jit
    def query_vectors(q_ptr, out_ptr, w_ptr, wout_ptr, rows, rmask, src, smask, c8, INV_SQRT_D, INV_SQRT_H,
                      BLOCK: tl.constexpr):
        # the vectors `rows` of the output from the input vectors `src` (zero where not smask)
        ptr = q_ptr + src[:, None] * 128 + c8[None, :]
        # all 16 loads first (memory-level parallelism), then the stages h = 1, 2, 4
        x0 = tl.load(ptr + 0, mask=smask[:, None], other=0.0)
        x1 = tl.load(ptr + 8, mask=smask[:, None], other=0.0)
        x2 = tl.load(ptr + 16, mask=smask[:, None], other=0.0)
        x3 = tl.load(ptr + 24, mask=smask[:, None], other=0.0)
        x4 = tl.load(ptr + 32, mask=smask[:, None], other=0.0)
        x5 = tl.load(ptr + 40, mask=smask[:, None], other=0.0)
        x6 = tl.load(ptr + 48, mask=smask[:, None], other=0.0)
        x7 = tl.load(ptr + 56, mask=smask[:, None], other=0.0)
        x8 = tl.load(ptr + 64, mask=smask[:, None], other=0.0)
        x9 = tl.load(ptr + 72, mask=smask[:, None], other=0.0)
        x10 = tl.load(ptr + 80, mask=smask[:, None], other=0.0)
        x11 = tl.load(ptr + 88, mask=smask[:, None], other=0.0)
        x12 = tl.load(ptr + 96, mask=smask[:, None], other=0.0)
        x13 = tl.load(ptr + 104, mask=smask[:, None], other=0.0)
        x14 = tl.load(ptr + 112, mask=smask[:, None], other=0.0)
        x15 = tl.load(ptr + 120, mask=smask[:, None], other=0.0)
        x0 = butterflies(x0.to(tl.float32), BLOCK, 8, 3)
        x1 = butterflies(x1.to(tl.float32), BLOCK, 8, 3)
        x2 = butterflies(x2.to(tl.float32), BLOCK, 8, 3)
        x3 = butterflies(x3.to(tl.float32), BLOCK, 8, 3)
        x4 = butterflies(x4.to(tl.float32), BLOCK, 8, 3)
        x5 = butterflies(x5.to(tl.float32), BLOCK, 8, 3)
        x6 = butterflies(x6.to(tl.float32), BLOCK, 8, 3)
        x7 = butterflies(x7.to(tl.float32), BLOCK, 8, 3)
        x8 = butterflies(x8.to(tl.float32), BLOCK, 8, 3)
        x9 = butterflies(x9.to(tl.float32), BLOCK, 8, 3)
        x10 = butterflies(x10.to(tl.float32), BLOCK, 8, 3)
        x11 = butterflies(x11.to(tl.float32), BLOCK, 8, 3)
        x12 = butterflies(x12.to(tl.float32), BLOCK, 8, 3)
        x13 = butterflies(x13.to(tl.float32), BLOCK, 8, 3)
        x14 = butterflies(x14.to(tl.float32), BLOCK, 8, 3)
        x15 = butterflies(x15.to(tl.float32), BLOCK, 8, 3)
        # h = 8: slices (m, m + 1), m even
        x0, x1 = bfly(x0, x1)
        x2, x3 = bfly(x2, x3)
        x4, x5 = bfly(x4, x5)
        x6, x7 = bfly(x6, x7)
        x8, x9 = bfly(x8, x9)
        x10, x11 = bfly(x10, x11)
        x12, x13 = bfly(x12, x13)
        x14, x15 = bfly(x14, x15)
        # h = 16: (m, m + 2), m mod 4 < 2
        x0, x2 = bfly(x0, x2)
        x1, x3 = bfly(x1, x3)
        x4, x6 = bfly(x4, x6)
        x5, x7 = bfly(x5, x7)
        x8, x10 = bfly(x8, x10)
        x9, x11 = bfly(x9, x11)
        x12, x14 = bfly(x12, x14)
        x13, x15 = bfly(x13, x15)
        # h = 32: (m, m + 4), m mod 8 < 4
        x0, x4 = bfly(x0, x4)
        x1, x5 = bfly(x1, x5)
        x2, x6 = bfly(x2, x6)
        x3, x7 = bfly(x3, x7)
        x8, x12 = bfly(x8, x12)
        x9, x13 = bfly(x9, x13)
        x10, x14 = bfly(x10, x14)
        x11, x15 = bfly(x11, x15)
        # h = 64: (m, m + 8)
        x0, x8 = bfly(x0, x8)
        x1, x9 = bfly(x1, x9)
        x2, x10 = bfly(x2, x10)
        x3, x11 = bfly(x3, x11)
        x4, x12 = bfly(x4, x12)
        x5, x13 = bfly(x5, x13)
        x6, x14 = bfly(x6, x14)
        x7, x15 = bfly(x7, x15)
        # * D^-0.5, BF16 round (as `quantize` after the generic kernel's hadamard)
        x0 = mul_rn(x0, INV_SQRT_D).to(tl.bfloat16).to(tl.float32)
        x1 = mul_rn(x1, INV_SQRT_D).to(tl.bfloat16).to(tl.float32)
        x2 = mul_rn(x2, INV_SQRT_D).to(tl.bfloat16).to(tl.float32)
        x3 = mul_rn(x3, INV_SQRT_D).to(tl.bfloat16).to(tl.float32)
        x4 = mul_rn(x4, INV_SQRT_D).to(tl.bfloat16).to(tl.float32)
        x5 = mul_rn(x5, INV_SQRT_D).to(tl.bfloat16).to(tl.float32)
        x6 = mul_rn(x6, INV_SQRT_D).to(tl.bfloat16).to(tl.float32)
        x7 = mul_rn(x7, INV_SQRT_D).to(tl.bfloat16).to(tl.float32)
        x8 = mul_rn(x8, INV_SQRT_D).to(tl.bfloat16).to(tl.float32)
        x9 = mul_rn(x9, INV_SQRT_D).to(tl.bfloat16).to(tl.float32)
        x10 = mul_rn(x10, INV_SQRT_D).to(tl.bfloat16).to(tl.float32)
        x11 = mul_rn(x11, INV_SQRT_D).to(tl.bfloat16).to(tl.float32)
        x12 = mul_rn(x12, INV_SQRT_D).to(tl.bfloat16).to(tl.float32)
        x13 = mul_rn(x13, INV_SQRT_D).to(tl.bfloat16).to(tl.float32)
        x14 = mul_rn(x14, INV_SQRT_D).to(tl.bfloat16).to(tl.float32)
        x15 = mul_rn(x15, INV_SQRT_D).to(tl.bfloat16).to(tl.float32)
        amax = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
                          tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))))
        amax = tl.maximum(amax, tl.maximum(tl.maximum(tl.maximum(tl.abs(x8), tl.abs(x9)), tl.maximum(tl.abs(x10), tl.abs(x11))),
                                           tl.maximum(tl.maximum(tl.abs(x12), tl.abs(x13)), tl.maximum(tl.abs(x14), tl.abs(x15)))))
        amax = tl.max(amax, axis=1)
        s = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
        bits = s.to(tl.int32, bitcast=True)
        scale = ((bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
        inv = tl.math.div_rn(tl.full((BLOCK,), 1.0, tl.float32), scale)
        # one [BLOCK, 128] store: the compiler lays it out for whole 16-byte pieces of
        # consecutive rows per warp (16 stores of 8 bytes strided by a row wrote partial
        # sectors: a fraction of the write bandwidth)
        y = join16(quant8(x0, inv), quant8(x1, inv), quant8(x2, inv), quant8(x3, inv), quant8(x4, inv),
                   quant8(x5, inv), quant8(x6, inv), quant8(x7, inv), quant8(x8, inv), quant8(x9, inv),
                   quant8(x10, inv), quant8(x11, inv), quant8(x12, inv), quant8(x13, inv), quant8(x14, inv),
                   quant8(x15, inv), BLOCK)
        tl.store(out_ptr + rows[:, None] * 128 + tl.arange(0, 128)[None, :], y, mask=rmask[:, None])
        # the folded head weight of each (row, head): ((w * H^-0.5) * scale) * D^-0.5 in FP32,
        # the order of the torch implementation
        w = tl.load(w_ptr + src, mask=smask, other=0.0).to(tl.float32)
        w = mul_rn(mul_rn(mul_rn(w, tl.full((BLOCK,), INV_SQRT_H, tl.float32)), scale), tl.full((BLOCK,), INV_SQRT_D, tl.float32))
        tl.store(wout_ptr + rows, w, mask=rmask)

    @triton.jit
    def query_kernel_128(q_ptr, out_ptr, w_ptr, wout_ptr, NR, PAD0, NV, INV_SQRT_D, INV_SQRT_H,
                         BLOCK: tl.constexpr):
        query_program_128(tl.program_id(0), q_ptr, out_ptr, w_ptr, wout_ptr, NR, PAD0, NV, INV_SQRT_D, INV_SQRT_H,
                          BLOCK)  # fmt: skip

    @triton.jit
    def prepare_fp8_kernel(q_ptr, q8_ptr, w_ptr, wout_ptr, NR, PAD0, NV, INV_SQRT_D, INV_SQRT_H, NQP,
                           k_ptr, g_ptr, ape_ptr, start_ptr, ext_ptr, k8_ptr, kscale_ptr, P, stride_k, stride_g,
                           K: tl.constexpr, QBLOCK: tl.constexpr, PBLOCK: tl.constexpr, EXT: tl.constexpr):
        # one launch for both preparations of the FP8 scoring (D = 128): programs [0, NQP)
        # run query_kernel_128's program, the others pool_kernel's (FP8); the same code, so
        # the same bits as the two launches
        pid = tl.program_id(0)
        if pid < NQP:
            query_program_128(pid, q_ptr, q8_ptr, w_ptr, wout_ptr, NR, PAD0, NV, INV_SQRT_D, INV_SQRT_H, QBLOCK)
        else:
            pool_program(pid - NQP, k_ptr, g_ptr, ape_ptr, start_ptr, ext_ptr, k8_ptr, kscale_ptr, P, stride_k,
                         stride_g, INV_SQRT_D, K, 128, 7, PBLOCK, True, EXT)  # fmt: skip

    @triton.jit
    def query_program_128(pid, q_ptr, out_ptr, w_ptr, wout_ptr, NR, PAD0, NV, INV_SQRT_D, INV_SQRT_H,
                          BLOCK: tl.constexpr):
        # One (row, head) vector of D = 128 per thread, as 16 slices of 8 adjacent channels
        # (x_m = channels 8m .. 8m + 7, one 16-byte load each): the butterfly stages
        # h = 1, 2, 4 act inside a slice (registers of one thread), h = 8 .. 64 between
        # slices m and m + h / 8 (element-wise). Same pairs and FP32 operations as
        # `hadamard`, without the data movement of the generic kernel.
        # Output vectors [0, NR); input vector i - PAD0 for i in [PAD0, PAD0 + NV), zero
        # input (zero output, as the arithmetic gives) elsewhere: a program with no input
        # vector only writes zeros.
        rows = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        rmask = rows < NR
        c8 = tl.arange(0, 8)
        v0 = pid * BLOCK
        if (v0 + BLOCK <= PAD0) | (v0 >= PAD0 + NV):
            zero = tl.zeros((BLOCK, 128), tl.float32).to(tl.float8e4nv)
            tl.store(out_ptr + rows[:, None] * 128 + tl.arange(0, 128)[None, :], zero, mask=rmask[:, None])
            tl.store(wout_ptr + rows, tl.zeros((BLOCK,), tl.float32), mask=rmask)
        else:
            query_vectors(q_ptr, out_ptr, w_ptr, wout_ptr, rows, rmask, rows - PAD0,
                          rmask & (rows >= PAD0) & (rows < PAD0 + NV), c8, INV_SQRT_D, INV_SQRT_H, BLOCK)

    return pool_kernel, query_kernel, query_kernel_128, prepare_fp8_kernel


#: Register cap of the D = 128 query kernel: 3 programs of 128 threads per SM. The kernel
#: needs 162-165 registers without spills (sm_90, Triton 3.6); one variant of its zero-row
#: branch made the compiler take 212 uncapped (2 programs per SM).
_QUERY_MAXNREG = 168


@functools.lru_cache(maxsize=None)
def _inv_sqrt_fp32(n: int) -> float:
    return float(torch.tensor(float(n) ** -0.5, dtype=torch.float32))


def _extend_arg(extend, pool_tok_start):
    """``(pointer tensor, EXT)`` of the kernels: ``extend [P]`` bool as uint8, or (no
    schedule) ``pool_tok_start`` standing in for a pointer the kernel never reads."""
    if extend is None:
        return pool_tok_start, False
    if extend.dtype != torch.bool or extend.shape != pool_tok_start.shape or extend.device != pool_tok_start.device:
        raise ValueError(f"extend: expected a bool tensor of shape {tuple(pool_tok_start.shape)} on "
                         f"{pool_tok_start.device}, got {extend.dtype} {tuple(extend.shape)} on {extend.device}")  # fmt: skip
    return extend.contiguous().view(torch.uint8), True


def pools_serving(k, gates, ape, pool_tok_start, fp8: bool, block: int = 16, extend=None):
    """Serving pools of the complete pools ``pool_tok_start [P]`` (int64, CUDA).

    ``k``, ``gates``: ``[S, D]`` (any float dtype, row-contiguous); ``ape``: ``[K, D]``;
    ``extend``: ``[P]`` bool, the pools compressed in extend order (``None``: all in decode
    order). Returns ``(k8 [P, D] float8_e4m3fn, k_scale [P] float32)`` when ``fp8``, else
    ``[P, D]`` bfloat16. Equal bit for bit to ``serving.prepare_pools_fp8`` /
    ``serving.prepare_pools_bf16_serving`` on the same device.
    """
    import triton

    pool_kernel = _kernels()[0]
    P, D, K = pool_tok_start.numel(), k.shape[1], ape.shape[0]
    dev = k.device
    out = torch.empty((P, D), dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=dev)
    scale = torch.empty((P,), dtype=torch.float32, device=dev)
    if P:
        k = k if k.stride(1) == 1 else k.contiguous()
        gates = gates if gates.stride(1) == 1 else gates.contiguous()
        grid = (triton.cdiv(P, block),)
        ext, has_ext = _extend_arg(extend, pool_tok_start)
        pool_kernel[grid](
            k, gates, ape.contiguous(), pool_tok_start.contiguous(), ext, out, scale, P, k.stride(0), gates.stride(0),
            _inv_sqrt_fp32(D), K=K, D=D, LOG2D=D.bit_length() - 1, BLOCK=block, FP8=fp8, EXT=has_ext,
        )  # fmt: skip
    return (out, scale) if fp8 else out


def queries_fp8(q: torch.Tensor, head_weights: torch.Tensor, block: int | None = None, generic: bool = False,
                before: int = 0, after: int = 0):  # fmt: skip
    """``(q8 [S, H, D] float8_e4m3fn, weights [S, H] float32)`` as
    ``serving.prepare_queries_fp8``: rotation and quantization in one kernel, the folded
    weights ``((w * H^-0.5) * q_scale) * D^-0.5`` (FP32).

    ``D = 128`` runs a kernel that keeps each ``(row, head)`` vector in one thread's
    registers (``block`` vectors per program, default 128) and also writes the folded
    weights; other ``D`` (or ``generic=True``) the generic kernel (``block`` default 32),
    the weights in torch. Both are bitwise equal to the torch implementation.

    ``before`` / ``after``: that many all-zero rows in front of / behind the ``S`` rows of
    both outputs (``[before + S + after, ...]``; what an all-zero input row gives), written
    in place (the pipeline scores chunks of a fixed row grid from views)."""
    import triton

    if before < 0 or after < 0:
        raise ValueError(f"before, after: expected row counts >= 0, got {before}, {after}")
    query_kernel, query_kernel_128 = _kernels()[1:3]
    S, H, D = q.shape
    n = before + S + after
    dev = q.device
    q8 = torch.empty((n, H, D), dtype=torch.float8_e4m3fn, device=dev)
    w = torch.empty((n, H), dtype=torch.float32, device=dev)
    q2 = q.reshape(S * H, D).contiguous()
    if D == 128 and not generic:
        # rotation, quantization, the folded weights and the zero rows in one kernel (no
        # host call for the padding; the scales exist only folded into the weights)
        block = block or 128
        if n * H:
            query_kernel_128[(triton.cdiv(n * H, block),)](
                q2, q8, head_weights.contiguous(), w, n * H, before * H, S * H, _inv_sqrt_fp32(D),
                _inv_sqrt_fp32(H), BLOCK=block, num_warps=max(1, block // 32), maxnreg=_QUERY_MAXNREG,
            )  # fmt: skip
        return q8, w
    for t in (q8, w):  # the padding rows
        t[:before].zero_()
        t[before + S :].zero_()
    qs = torch.empty((S * H,), dtype=torch.float32, device=dev)
    if S * H:
        block = block or 32
        query_kernel[(triton.cdiv(S * H, block),)](
            q2, q8[before : before + S].view(S * H, D), qs, S * H, _inv_sqrt_fp32(D), D=D, LOG2D=D.bit_length() - 1,
            BLOCK=block,
        )  # fmt: skip
    wf = head_weights.float() * _inv_sqrt_fp32(H)
    wf = wf * qs.view(S, H)
    w[before : before + S] = wf * _inv_sqrt_fp32(D)
    return q8, w


def prepare_fp8(q: torch.Tensor, head_weights: torch.Tensor, k, gates, ape, pool_tok_start: torch.Tensor,
                before: int = 0, after: int = 0, extend=None):  # fmt: skip
    """``((k8, k_scale), (q8, w))``: :func:`pools_serving` ``(k, gates, ape, pool_tok_start,
    fp8=True, extend=extend)`` and :func:`queries_fp8` ``(q, head_weights, before=,
    after=)``, equal to them
    bit for bit, in **one** kernel launch where ``D = 128`` (the same kernel code; each
    launch costs host time before the first scoring call). Other shapes (or nothing to
    pool, or no query rows) call the two functions.

    Shapes and dtypes as the two functions: ``q [S, H, 128]``, ``head_weights [S, H]``,
    ``k``, ``gates`` ``[N, 128]``, ``ape [K, 128]``, ``pool_tok_start [P]`` int64 (CUDA);
    returns ``k8 [P, 128]`` float8_e4m3fn, ``k_scale [P]`` float32, ``q8 [before + S +
    after, H, 128]`` float8_e4m3fn, ``w [before + S + after, H]`` float32."""
    import triton

    if before < 0 or after < 0:
        raise ValueError(f"before, after: expected row counts >= 0, got {before}, {after}")
    S, H, D = q.shape
    P, K = pool_tok_start.numel(), ape.shape[0]
    n = before + S + after
    if D != 128 or k.shape[1] != 128 or P == 0 or n * H == 0:
        return (pools_serving(k, gates, ape, pool_tok_start, fp8=True, extend=extend),
                queries_fp8(q, head_weights, before=before, after=after))  # fmt: skip
    kernel = _kernels()[3]
    dev = q.device
    q8 = torch.empty((n, H, D), dtype=torch.float8_e4m3fn, device=dev)
    w = torch.empty((n, H), dtype=torch.float32, device=dev)
    k8 = torch.empty((P, D), dtype=torch.float8_e4m3fn, device=dev)
    k_scale = torch.empty((P,), dtype=torch.float32, device=dev)
    k = k if k.stride(1) == 1 else k.contiguous()
    gates = gates if gates.stride(1) == 1 else gates.contiguous()
    qblock, pblock = 128, 16  # the defaults of queries_fp8 and pools_serving
    nqp = triton.cdiv(n * H, qblock)
    ext, has_ext = _extend_arg(extend, pool_tok_start)
    kernel[(nqp + triton.cdiv(P, pblock),)](
        q.reshape(S * H, D).contiguous(), q8, head_weights.contiguous(), w, n * H, before * H, S * H, _inv_sqrt_fp32(D),
        _inv_sqrt_fp32(H), nqp, k, gates, ape.contiguous(), pool_tok_start.contiguous(), ext, k8, k_scale, P,
        k.stride(0), gates.stride(0), K=K, QBLOCK=qblock, PBLOCK=pblock, EXT=has_ext, num_warps=qblock // 32,
        maxnreg=_QUERY_MAXNREG,
    )  # fmt: skip
    return (k8, k_scale), (q8, w)
