"""Triton kernels of the serving arithmetic (SPEC 6), bitwise equal to :mod:`sp_kpool.serving`.

* :func:`pools_serving`: decode-mode compression (two passes, FP32, slots in order), then
  either BF16 storage (``bf16-serving``) or BF16 round -> Hadamard -> BF16 round -> E4M3
  with a UE8M0 scale per pool (``fp8``), in one kernel.
* :func:`queries_fp8`: Hadamard -> BF16 round -> E4M3 with a scale per (row, head).

Exactness: products and sums that torch runs as separate kernels are written as PTX
``mul.rn.f32`` / ``add.rn.f32`` (never contracted into an FMA), divisions as
``div_rn``, ``exp`` as libdevice's ``expf`` (the same as torch's CUDA ``exp``).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["pools_serving", "queries_fp8"]


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def mul_rn(a, b):
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def add_rn(a, b):
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1)

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
    def hadamard(x, BLOCK: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr, INV_SQRT_D):
        # butterfly stages h = 1, 2, 4, ..., D / 2, then * D^-0.5
        for st in tl.static_range(LOG2D):
            x = butterfly(x, BLOCK, D, 1 << st)
        return mul_rn(x, INV_SQRT_D)

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
    def pool_kernel(k_ptr, g_ptr, ape_ptr, start_ptr, out_ptr, scale_ptr, P, stride_k, stride_g, INV_SQRT_D,
                    K: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr):
        pid = tl.program_id(0)
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
        for j in tl.static_range(K):
            g = tl.load(g_ptr + (base + j)[:, None] * stride_g + cols[None, :], mask=rmask[:, None], other=0.0)
            a = tl.load(ape_ptr + j * D + cols)
            s = add_rn(g.to(tl.float32), a.to(tl.float32)[None, :])
            e = libdevice.exp(add_rn(s, -m))
            den = add_rn(den, e)
            kv = tl.load(k_ptr + (base + j)[:, None] * stride_k + cols[None, :], mask=rmask[:, None], other=0.0)
            num = add_rn(num, mul_rn(kv.to(tl.float32), e))
        pooled = tl.math.div_rn(num, den)
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

    return pool_kernel, query_kernel


def _inv_sqrt_fp32(n: int) -> float:
    return float(torch.tensor(float(n) ** -0.5, dtype=torch.float32))


def pools_serving(k, gates, ape, pool_tok_start, fp8: bool, block: int = 16):
    """Serving pools of the complete pools ``pool_tok_start [P]`` (int64, CUDA).

    ``k``, ``gates``: ``[S, D]`` (any float dtype, row-contiguous); ``ape``: ``[K, D]``.
    Returns ``(k8 [P, D] float8_e4m3fn, k_scale [P] float32)`` when ``fp8``, else
    ``[P, D]`` bfloat16. Equal bit for bit to ``serving.prepare_pools_fp8`` /
    ``serving.prepare_pools_bf16_serving`` on the same device.
    """
    import triton

    pool_kernel, _ = _kernels()
    P, (S, D), K = pool_tok_start.numel(), k.shape, ape.shape[0]
    dev = k.device
    out = torch.empty((P, D), dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=dev)
    scale = torch.empty((P,), dtype=torch.float32, device=dev)
    if P:
        k = k if k.stride(1) == 1 else k.contiguous()
        gates = gates if gates.stride(1) == 1 else gates.contiguous()
        grid = (triton.cdiv(P, block),)
        pool_kernel[grid](
            k, gates, ape.contiguous(), pool_tok_start.contiguous(), out, scale, P, k.stride(0), gates.stride(0),
            _inv_sqrt_fp32(D), K=K, D=D, LOG2D=D.bit_length() - 1, BLOCK=block, FP8=fp8,
        )  # fmt: skip
    return (out, scale) if fp8 else out


def queries_fp8(q: torch.Tensor, head_weights: torch.Tensor, block: int = 32):
    """``(q8 [S, H, D] float8_e4m3fn, weights [S, H] float32)`` as
    ``serving.prepare_queries_fp8``: rotation and quantization in one kernel, the folded
    weights ``((w * H^-0.5) * q_scale) * D^-0.5`` in torch (FP32)."""
    import triton

    _, query_kernel = _kernels()
    S, H, D = q.shape
    q2 = q.reshape(S * H, D).contiguous()
    q8 = torch.empty((S * H, D), dtype=torch.float8_e4m3fn, device=q.device)
    qs = torch.empty((S * H,), dtype=torch.float32, device=q.device)
    if S * H:
        grid = (triton.cdiv(S * H, block),)
        query_kernel[grid](q2, q8, qs, S * H, _inv_sqrt_fp32(D), D=D, LOG2D=D.bit_length() - 1, BLOCK=block)
    w = head_weights.float() * _inv_sqrt_fp32(H)
    w = w * qs.view(S, H)
    w = w * _inv_sqrt_fp32(D)
    return q8.view(S, H, D), w
