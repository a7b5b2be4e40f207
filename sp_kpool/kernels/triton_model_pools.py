"""Triton kernel of the model's pooling (contract §2): :func:`pools_model`, the
model-definition pools (``bf16``) in one launch, bitwise equal to
:func:`sp_kpool.pooling.compress_pools_bf16` on the GPU (about a dozen torch kernels), for
the shapes of :func:`pools_model_supports`.

Exactness as in :mod:`sp_kpool.kernels.triton_serving`: products and sums that torch runs as
separate kernels are written as PTX ``mul.rn.f32`` / ``add.rn.f32``
(:mod:`sp_kpool.kernels.triton_rounding`), divisions as ``div_rn``, ``exp`` as libdevice's
``expf`` (the same as torch's CUDA ``exp``).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["pools_model", "pools_model_supports"]


@functools.lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from .triton_rounding import add_rn, mul_rn

    @triton.jit
    def model_pool_kernel(k_ptr, g_ptr, ape_ptr, start_ptr, out_ptr, P, stride_k, stride_g, K: tl.constexpr,
                          D: tl.constexpr, BLOCK: tl.constexpr):
        # pools pid * BLOCK .. pid * BLOCK + BLOCK - 1 in the model arithmetic
        # (`pooling.compress_pools_bf16`), each step as the CUDA kernels of its torch ops
        # compute it: the FP32 slot softmax of the spatial softmax kernel (the maximum from
        # FP32's lowest value, `m < s ? s : m`, so NaN never wins; the sum from 0 in slot
        # order; `exp(s - m) / sum`), the BF16 probabilities times the BF16 keys rounded to
        # BF16 (the FP32 product is exact), their FP32 sum as the reduction kernel takes it
        # (four accumulators from 0, slot j into accumulator j % 4 in slot order, combined
        # ((a0 + a1) + a2) + a3; for K <= 4 the same bits as one sum in slot order) rounded
        # to BF16 once
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        rmask = rows < P
        cols = tl.arange(0, D)
        base = tl.load(start_ptr + rows, mask=rmask, other=0).to(tl.int64)
        m = tl.full((BLOCK, D), -3.4028234663852886e38, tl.float32)
        for j in tl.static_range(K):
            g = tl.load(g_ptr + (base + j)[:, None] * stride_g + cols[None, :], mask=rmask[:, None], other=0.0)
            s = add_rn(g.to(tl.float32), tl.load(ape_ptr + j * D + cols).to(tl.float32)[None, :])
            m = tl.where(m < s, s, m)
        den = tl.zeros((BLOCK, D), tl.float32)
        for j in tl.static_range(K):
            g = tl.load(g_ptr + (base + j)[:, None] * stride_g + cols[None, :], mask=rmask[:, None], other=0.0)
            s = add_rn(g.to(tl.float32), tl.load(ape_ptr + j * D + cols).to(tl.float32)[None, :])
            den = add_rn(den, libdevice.exp(add_rn(s, -m)))
        a0 = tl.zeros((BLOCK, D), tl.float32)
        a1 = tl.zeros((BLOCK, D), tl.float32)
        a2 = tl.zeros((BLOCK, D), tl.float32)
        a3 = tl.zeros((BLOCK, D), tl.float32)
        for j in tl.static_range(K):
            g = tl.load(g_ptr + (base + j)[:, None] * stride_g + cols[None, :], mask=rmask[:, None], other=0.0)
            s = add_rn(g.to(tl.float32), tl.load(ape_ptr + j * D + cols).to(tl.float32)[None, :])
            p = tl.math.div_rn(libdevice.exp(add_rn(s, -m)), den).to(tl.bfloat16).to(tl.float32)
            kv = tl.load(k_ptr + (base + j)[:, None] * stride_k + cols[None, :], mask=rmask[:, None], other=0.0)
            x = mul_rn(p, kv.to(tl.float32)).to(tl.bfloat16).to(tl.float32)
            if j % 4 == 0:
                a0 = add_rn(a0, x)
            elif j % 4 == 1:
                a1 = add_rn(a1, x)
            elif j % 4 == 2:
                a2 = add_rn(a2, x)
            else:
                a3 = add_rn(a3, x)
        acc = add_rn(add_rn(add_rn(a0, a1), a2), a3)
        tl.store(out_ptr + rows[:, None] * D + cols[None, :], acc.to(tl.bfloat16), mask=rmask[:, None])

    return model_pool_kernel


def pools_model_supports(kpool: int, dim: int) -> bool:
    """Whether :func:`pools_model` takes pools of ``kpool`` slots of ``dim`` channels: the
    shapes whose torch reduction order it reproduces (four accumulators; the GPU tests
    compare K 1, 4 and 16 at D 128 and K 1 at D 64 bit for bit). Up to 4 slots torch's sum
    is one sum in slot order whatever its launch; more slots only at D 128, up to 16 (a
    longer slot sum may be split across threads, in an order not reproduced here)."""
    return dim in (64, 128) and (kpool <= 4 or (kpool <= 16 and dim == 128))


def pools_model(k: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor, pool_tok_start: torch.Tensor,
                block: int = 16) -> torch.Tensor:  # fmt: skip
    """The model-definition pools (``bf16``) of ``pool_tok_start [P]`` (int64, CUDA) in one
    launch: :func:`sp_kpool.pooling.compress_pools_bf16` bit for bit on the same GPU, which
    runs about a dozen torch kernels (two gathers, the softmax, casts, the product and
    the reduction).

    ``k``: ``[S, D]`` bfloat16 (row-contiguous); ``gates``: ``[S, D]`` bfloat16 or float32;
    ``ape``: ``[K, D]`` (any float dtype), with :func:`pools_model_supports` ``(K, D)``.
    Returns ``[P, D]`` bfloat16."""
    import triton

    if k.dtype != torch.bfloat16:
        raise ValueError(f"k: expected bfloat16 (the model's key dtype), got {k.dtype}")
    if k.dim() != 2 or gates.shape != k.shape:
        raise ValueError(f"gates: expected the shape of k, {tuple(k.shape)}, got {tuple(gates.shape)}")
    if ape.dim() != 2 or ape.shape[1] != k.shape[1]:
        raise ValueError(f"ape: expected [K, {k.shape[1]}], got {tuple(ape.shape)}")
    if not pools_model_supports(ape.shape[0], k.shape[1]):
        raise ValueError(f"ape: K = {ape.shape[0]} slots of D = {k.shape[1]} channels is not a shape whose torch "
                         f"order this kernel reproduces (see pools_model_supports)")  # fmt: skip
    if pool_tok_start.dim() != 1 or pool_tok_start.dtype != torch.int64:
        raise ValueError(f"pool_tok_start: expected a 1-D int64 tensor, got {pool_tok_start.dtype} "
                         f"{tuple(pool_tok_start.shape)}")  # fmt: skip
    P, D, K = pool_tok_start.numel(), k.shape[1], ape.shape[0]
    out = torch.empty((P, D), dtype=torch.bfloat16, device=k.device)
    if P:
        k = k if k.stride(1) == 1 else k.contiguous()
        gates = gates if gates.stride(1) == 1 else gates.contiguous()
        _kernel()[(triton.cdiv(P, block),)](
            k, gates, ape.contiguous(), pool_tok_start.contiguous(), out, P, k.stride(0), gates.stride(0), K=K, D=D,
            BLOCK=block,
        )  # fmt: skip
    return out
