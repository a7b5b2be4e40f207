"""The scoring references of the serving arithmetic (contract §3 and §6 step 6), in plain torch.

* :func:`mqa_logits_fp8_reference`: the dequantized reference of DeepGEMM's
  ``fp8_mqa_logits`` on the pools and queries of :mod:`sp_kpool.serving`;
* :func:`scores_bf16_serving`: the BF16 serving arm's scores (FP32 arithmetic).

Both compute in FP32 whatever the ambient autocast state, on CPU and CUDA, with IEEE FP32
matrix products (see :mod:`sp_kpool.serving`).
"""

from __future__ import annotations

import torch

from .checks import (
    check_device, check_dim, check_dtype, check_float_dtype, check_is_tensor, check_ndim, check_positive_int,
)  # fmt: skip
from .serving import _fp32_region, _inv_sqrt_fp32

__all__ = ["mqa_logits_fp8_reference", "scores_bf16_serving"]


def mqa_logits_fp8_reference(
    q8: torch.Tensor,
    weights: torch.Tensor,
    k8: torch.Tensor,
    k_scale: torch.Tensor,
    chunk_rows: int = 256,
) -> torch.Tensor:
    """Dequantized reference of DeepGEMM ``fp8_mqa_logits`` (contract §6 step 6), all pairs, no mask.

    Args:
        q8: ``[S, H, D]``, float8_e4m3fn; from :func:`prepare_queries_fp8`.
        weights: ``[S, H]``, float32; the folded ``weight'``.
        k8: ``[P, D]``, float8_e4m3fn; from :func:`prepare_pools_fp8`.
        k_scale: ``[P]``, float32.
        chunk_rows: query rows per chunk; peak extra memory is about
            ``2 * chunk_rows * P * 4`` bytes plus the FP32 copies of the inputs.

    Returns:
        ``[S, P]``, float32: ``k_scale[p] * sum_h weights[t, h] * ReLU(<q8[t, h], k8[p]>)``.
        Order: per head ``h = 0..H-1`` an IEEE FP32 matmul of the dequantized (``.float()``)
        values, ReLU, times ``weights[:, h]``, added to an FP32 accumulator; then times
        ``k_scale``. No causal mask: restrict to valid slots yourself.
    """
    for name, t in (("q8", q8), ("weights", weights), ("k8", k8), ("k_scale", k_scale)):
        check_is_tensor(name, t)
    check_dtype("q8", q8, torch.float8_e4m3fn)
    check_dtype("weights", weights, torch.float32)
    check_dtype("k8", k8, torch.float8_e4m3fn)
    check_dtype("k_scale", k_scale, torch.float32)
    check_ndim("q8", q8, 3, "[S, H, D]")
    check_ndim("weights", weights, 2, "[S, H]")
    check_ndim("k8", k8, 2, "[P, D]")
    check_ndim("k_scale", k_scale, 1, "[P]")
    check_positive_int("chunk_rows", chunk_rows)
    s_tok, heads, d = q8.shape
    n_pools = k8.shape[0]
    if weights.shape != (s_tok, heads):
        raise ValueError(
            f"weights: expected shape {(s_tok, heads)} ([S, H] of q8), got {tuple(weights.shape)}"
        )
    check_dim("k8", k8, 1, d, "D of q8")
    check_dim("k_scale", k_scale, 0, n_pools, "P of k8")
    for name, t in (("weights", weights), ("k8", k8), ("k_scale", k_scale)):
        check_device(name, t, q8.device)
    with _fp32_region(q8.device):
        out = torch.empty((s_tok, n_pools), dtype=torch.float32, device=q8.device)
        k_t = k8.float().t()
        for r0 in range(0, s_tok, chunk_rows):
            r1 = min(r0 + chunk_rows, s_tok)
            qf = q8[r0:r1].float()
            w = weights[r0:r1]
            acc = torch.zeros((r1 - r0, n_pools), dtype=torch.float32, device=q8.device)
            for h in range(heads):
                acc += torch.relu(qf[:, h, :] @ k_t) * w[:, h, None]
            out[r0:r1] = acc * k_scale
        return out


def scores_bf16_serving(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    pools_bf16: torch.Tensor,
    chunk_rows: int = 256,
) -> torch.Tensor:
    """The contract §3 score against (BF16) pools, FP32 arithmetic, all pairs, no mask.

    Args:
        q: ``[S, H, D]``, any float dtype (used as ``q.float()``).
        head_weights: ``[S, H]``, any float dtype (used as ``.float()``).
        pools_bf16: ``[P, D]``, bfloat16 from :func:`prepare_pools_bf16_serving` (any
            float dtype is accepted and used as ``.float()``).
        chunk_rows: query rows per chunk (memory about ``2 * chunk_rows * P * 4`` bytes).

    Returns:
        ``[S, P]``, float32: ``sum_h (w[t, h] * H^-0.5) * ReLU(D^-0.5 * <q[t, h], pool[p]>)``.
        Order: ``w' = w.float() * fp32(H^-0.5)``; per head ``h = 0..H-1``: IEEE FP32 matmul,
        times ``fp32(D^-0.5)``, ReLU, times ``w'[:, h]``, added to an FP32 accumulator.
    """
    for name, t in (("q", q), ("head_weights", head_weights), ("pools_bf16", pools_bf16)):
        check_is_tensor(name, t)
    check_float_dtype("q", q)
    check_float_dtype("head_weights", head_weights)
    check_float_dtype("pools_bf16", pools_bf16)
    check_ndim("q", q, 3, "[S, H, D]")
    check_ndim("head_weights", head_weights, 2, "[S, H]")
    check_ndim("pools_bf16", pools_bf16, 2, "[P, D]")
    check_positive_int("chunk_rows", chunk_rows)
    s_tok, heads, d = q.shape
    n_pools = pools_bf16.shape[0]
    if head_weights.shape != (s_tok, heads):
        raise ValueError(
            f"head_weights: expected shape {(s_tok, heads)} ([S, H] of q), "
            f"got {tuple(head_weights.shape)}"
        )
    check_dim("pools_bf16", pools_bf16, 1, d, "D of q")
    for name, t in (("head_weights", head_weights), ("pools_bf16", pools_bf16)):
        check_device(name, t, q.device)
    c_d = _inv_sqrt_fp32(d)
    with _fp32_region(q.device):
        out = torch.empty((s_tok, n_pools), dtype=torch.float32, device=q.device)
        p_t = pools_bf16.float().t()
        w_all = head_weights.float() * _inv_sqrt_fp32(heads)
        for r0 in range(0, s_tok, chunk_rows):
            r1 = min(r0 + chunk_rows, s_tok)
            qf = q[r0:r1].float()
            w = w_all[r0:r1]
            acc = torch.zeros((r1 - r0, n_pools), dtype=torch.float32, device=q.device)
            for h in range(heads):
                acc += torch.relu((qf[:, h, :] @ p_t) * c_d) * w[:, h, None]
            out[r0:r1] = acc
        return out
