"""FP8 serving arithmetic of the rollout engine (contract §6), in plain torch.

This module reproduces, value for value, how serving (LMDeploy's GLM-5.3 KPool path)
builds and scores index pools, so that the FP8 adapter can be checked bit for bit:

    closed pool                                   query
    -----------                                   -----
    compress_pools_serving (FP32: decode order,   q.float()
      two passes, or extend order, online)
    -> round to BF16, back to FP32                -> hadamard (FP32)
    -> hadamard (FP32)                            -> round to BF16
    -> round to BF16                              -> quantize_e4m3 per (row, head)
    -> quantize_e4m3 per pool                     -> weights' = w * H^-0.5 * q_scale * D^-0.5
                 \\                               /
                  serving_scores.mqa_logits_fp8_reference  (DeepGEMM fp8_mqa_logits, dequantized)

``prepare_pools_bf16_serving`` (and :func:`sp_kpool.serving_scores.scores_bf16_serving`)
are the BF16 arm on the same pools (no rotation), scored per contract §3 in FP32. The
scoring references are in :mod:`sp_kpool.serving_scores`. Which pools take the extend order
(those closed during the prompt's prefill) is :func:`sp_kpool.pooling.extend_pools`.

Every function computes in FP32 whatever the ambient autocast state (autocast is disabled
inside), works on CPU and CUDA, and has no distributed code. Matrix products additionally
force IEEE FP32 (``torch.set_float32_matmul_precision("highest")``) for their duration:
TF32 or BF16-pass matmuls would silently break the reference. That setting is
process-global; it is restored on exit, but do not rely on it from another thread while
one of these functions runs.

Constants ``H^-0.5`` and ``D^-0.5`` are Python's ``n ** -0.5`` rounded once to FP32 and
applied as an FP32 multiplication.
"""

from __future__ import annotations

import contextlib
import math
import struct
from collections.abc import Iterator

import torch

from .checks import (
    check_device, check_dim, check_dtype, check_float_dtype, check_is_tensor, check_ndim, check_power_of_two,
)  # fmt: skip

__all__ = [
    "FP8_E4M3_MAX",
    "SCALE_ABSMAX_FLOOR",
    "hadamard",
    "ue8m0_scale",
    "quantize_e4m3",
    "compress_pools_decode",
    "compress_pools_extend",
    "compress_pools_serving",
    "prepare_pools_bf16_serving",
    "prepare_pools_fp8",
    "prepare_queries_fp8",
]

#: Largest finite magnitude of ``float8_e4m3fn``.
FP8_E4M3_MAX = 448.0
#: Lower bound applied to a vector's absmax before deriving its scale (contract §6 step 4).
SCALE_ABSMAX_FLOOR = 1e-4

# Dtypes whose conversion to FP32 is exact.
_EXACT_TO_FP32 = (torch.float32, torch.bfloat16, torch.float16)
_F32_EXP_MASK = 0x7F800000
_F32_MANT_MASK = 0x007FFFFF


# --------------------------------------------------------------------------- helpers


def _fp32_const(value: float) -> float:
    """``value`` rounded to the nearest FP32, returned as a Python float (exact in FP32)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _inv_sqrt_fp32(n: int) -> float:
    return _fp32_const(float(n) ** -0.5)


@contextlib.contextmanager
def _fp32_region(device: torch.device) -> Iterator[None]:
    """Autocast off for ``device`` and IEEE FP32 matmuls for the duration."""
    previous = torch.get_float32_matmul_precision()
    if previous != "highest":
        torch.set_float32_matmul_precision("highest")
    try:
        with torch.autocast(device_type=device.type, enabled=False):
            yield
    finally:
        if previous != "highest":
            torch.set_float32_matmul_precision(previous)


# --------------------------------------------------------------------- primitives


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Normalized Walsh–Hadamard transform over the last dim, in FP32 (contract §6 step 3).

    Args:
        x: ``[..., D]``, any float dtype; ``D`` must be a power of two. It is converted with
            ``x.float()`` first (exact for BF16/FP16, rounding for FP64).

    Returns:
        ``[..., D]``, float32: ``H_D @ x * D^-0.5`` with ``H_D`` Sylvester's (natural
        order) Hadamard matrix, ``H_2 = [[1, 1], [1, -1]]``.

    Arithmetic (fixed, hence bitwise reproducible): butterfly stages ``h = 1, 2, 4, ...,
    D/2``; in each, every pair ``(a, b) = (x[j], x[j + h])`` with ``j mod 2h < h`` becomes
    ``(a + b, a - b)`` in FP32. Then one FP32 multiplication by ``D^-0.5`` rounded to FP32.
    The result is not rounded to BF16: serving rounds after rotating, and that rounding
    (``.to(torch.bfloat16)``) is the caller's job.

    Raises:
        ValueError: ``D`` is not a power of two (the message names it).
    """
    x = check_is_tensor("x", x)
    check_float_dtype("x", x)
    if x.dim() < 1:
        raise ValueError(f"x: expected at least 1 dim [..., D], got shape {tuple(x.shape)}")
    d = x.shape[-1]
    check_power_of_two("x", d)
    lead = x.shape[:-1]
    with _fp32_region(x.device):
        y = x.float().contiguous()
        h = 1
        while h < d:
            pairs = y.view(*lead, d // (2 * h), 2, h)
            a = pairs[..., 0, :]
            b = pairs[..., 1, :]
            y = torch.stack((a + b, a - b), dim=-2).view(*lead, d)
            h *= 2
        return y * _inv_sqrt_fp32(d)


def ue8m0_scale(absmax: torch.Tensor) -> torch.Tensor:
    """Per-vector FP8 scale, rounded up to a power of two (UE8M0; contract §6 step 4).

    Args:
        absmax: ``[...]``, float32 / bfloat16 / float16 (converted exactly to FP32); the
            absolute maximum of each vector.

    Returns:
        ``[...]``, float32: ``max(absmax, 1e-4) / 448`` (FP32 ``max`` against FP32(1e-4),
        FP32 correctly rounded division), then rounded **up** to the next power of two;
        an exact power of two stays. The rounding is done on the bits (add the mantissa
        mask, clear the mantissa), so no ``log2`` error can creep in. The floor gives a
        smallest scale of ``2^-22`` (FP32(1e-4) / 448 ~ 2.23e-7). ``+inf`` maps to
        ``+inf`` and NaN to NaN.
    """
    absmax = check_is_tensor("absmax", absmax)
    check_float_dtype("absmax", absmax, _EXACT_TO_FP32)
    with _fp32_region(absmax.device):
        s = torch.clamp_min(absmax.float(), _fp32_const(SCALE_ABSMAX_FLOOR)) / FP8_E4M3_MAX
        # s is positive and normal (>= 2^-23) or +inf; ceil to a power of two on the bits.
        bits = s.contiguous().view(torch.int32)
        up = torch.bitwise_and(bits + _F32_MANT_MASK, _F32_EXP_MASK).view(torch.float32)
        return torch.where(torch.isnan(s), s, up)


def quantize_e4m3(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to ``float8_e4m3fn`` with one UE8M0 scale per vector along ``dim`` (contract §6 step 4).

    Args:
        x: ``[...]``, float32 (bfloat16 / float16 accepted, converted exactly). Serving
            quantizes BF16-rounded values: pass them either as BF16 or as FP32 holding BF16
            values (``t.to(torch.bfloat16).float()``); the result is the same.
        dim: the axis of the vectors.

    Returns:
        values: same shape as ``x``, float8_e4m3fn:
            ``clamp(x / scale, -448, 448).to(float8_e4m3fn)`` (FP32 division, exact since
            the scale is a power of two; round to nearest even on conversion).
        scales: ``x.shape`` without ``dim``, float32: ``ue8m0_scale(amax(|x|, dim))``.
    """
    x = check_is_tensor("x", x)
    check_float_dtype("x", x, _EXACT_TO_FP32)
    if x.dim() < 1:
        raise ValueError(f"x: expected at least 1 dim, got shape {tuple(x.shape)}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"dim: expected in [{-x.dim()}, {x.dim()}) for x of shape {tuple(x.shape)}, got {dim}"
        )
    if x.shape[dim] == 0:
        raise ValueError(
            f"x: expected a non-empty dim {dim} to quantize along, got shape {tuple(x.shape)}"
        )
    with _fp32_region(x.device):
        xf = x.float()
        scales = ue8m0_scale(xf.abs().amax(dim=dim))
        q = torch.clamp(xf / scales.unsqueeze(dim), -FP8_E4M3_MAX, FP8_E4M3_MAX)
        return q.to(torch.float8_e4m3fn), scales


# ------------------------------------------------------------------ pool compression


def _check_pool_args(k, gates, ape, pool_tok_start) -> tuple[torch.Tensor, ...]:
    """The arguments of the compression functions, checked (see :func:`compress_pools_decode`)."""
    k = check_is_tensor("k", k)
    gates = check_is_tensor("gates", gates)
    ape = check_is_tensor("ape", ape)
    pool_tok_start = check_is_tensor("pool_tok_start", pool_tok_start)
    check_float_dtype("k", k)
    check_float_dtype("gates", gates)
    check_float_dtype("ape", ape)
    check_dtype("pool_tok_start", pool_tok_start, torch.int64)
    check_ndim("k", k, 2, "[S, D]")
    check_ndim("gates", gates, 2, "[S, D]")
    check_ndim("ape", ape, 2, "[K, D]")
    check_ndim("pool_tok_start", pool_tok_start, 1, "[P]")
    s_tok, d = k.shape
    pool = ape.shape[0]
    if gates.shape != k.shape:
        raise ValueError(
            f"gates: expected shape {tuple(k.shape)} (same as k [S, D]), got {tuple(gates.shape)}"
        )
    check_dim("ape", ape, 1, d, "D")
    if pool < 1:
        raise ValueError(f"ape: expected K >= 1 rows [K, D], got shape {tuple(ape.shape)}")
    for name, t in (("gates", gates), ("ape", ape), ("pool_tok_start", pool_tok_start)):
        check_device(name, t, k.device)
    if pool_tok_start.shape[0] > 0:
        lo, hi = torch.stack((pool_tok_start.min(), pool_tok_start.max())).tolist()
        if lo < 0 or hi > s_tok - pool:
            raise ValueError(
                f"pool_tok_start: expected values in [0, S - K] = [0, {s_tok - pool}] "
                f"(S={s_tok}, K={pool}), got min {lo}, max {hi}"
            )
    return k, gates, ape, pool_tok_start


def _compress(k, gates, ape, pool_tok_start, order) -> torch.Tensor:
    """The arguments checked, then ``order(k, rows, logits)`` in FP32 with autocast off:
    ``rows[j]`` the rows of slot ``j`` of every pool, ``logits[j] = f32(g) + f32(ape_j)``
    ``[P, D]``; ``[0, D]`` float32 without pools."""
    k, gates, ape, pool_tok_start = _check_pool_args(k, gates, ape, pool_tok_start)
    with _fp32_region(k.device):
        if pool_tok_start.shape[0] == 0:
            return torch.zeros((0, k.shape[1]), dtype=torch.float32, device=k.device)
        rows = [pool_tok_start + j for j in range(ape.shape[0])]
        ape_f = ape.float()
        logits = [gates.index_select(0, rows[j]).float() + ape_f[j] for j in range(ape.shape[0])]
        return order(k, rows, logits)


def compress_pools_decode(
    k: torch.Tensor,
    gates: torch.Tensor,
    ape: torch.Tensor,
    pool_tok_start: torch.Tensor,
) -> torch.Tensor:
    """Pool keys in serving's "decode" order (two passes), FP32 (contract §2 and §6 step 1).

    Args:
        k: ``[S, D]``, any float dtype; the normalized index keys.
        gates: ``[S, D]``, any float dtype; the per-token, per-channel pool gate ``g``.
        ape: ``[K, D]``, any float dtype; the per-slot, per-channel bias. ``K`` = pool size.
        pool_tok_start: ``[P]``, int64; token id (row of ``k``) of slot 0 of each
            **complete** pool: pool ``p`` covers rows ``pool_tok_start[p] + 0 .. K-1``.
            Partial pools are never compressed here. Checked to lie in ``[0, S - K]``
            (one host sync).

    Returns:
        ``[P, D]``, float32: ``num / den`` per pool and channel, where with
        ``s_j = gates[t_j].float() + ape[j].float()`` (``t_j`` the token of slot ``j``):

        - pass 1: ``m = max_j s_j`` (``torch.maximum`` over slots ``0..K-1``);
        - pass 2, slots in order ``j = 0..K-1``, FP32 accumulators starting at zero:
          ``e = exp(s_j - m)``, ``den = den + e``, ``num = num + (k[t_j].float() * e)``
          (the product is rounded before the add: no FMA).

        The order is explicit (a Python loop over slots), so results do not depend on
        reduction heuristics; ``exp`` is the backend's FP32 ``torch.exp`` (CPU and CUDA
        ``exp`` may differ in the last bit). Serving's "extend" order is
        :func:`compress_pools_extend`.
    """
    return _compress(k, gates, ape, pool_tok_start, _decode_order)


def _decode_order(k, rows, logits):
    m = logits[0]
    for j in range(1, len(rows)):
        m = torch.maximum(m, logits[j])
    den = torch.zeros_like(m)
    num = torch.zeros_like(m)
    for j in range(len(rows)):
        e = torch.exp(logits[j] - m)
        den = den + e
        num = num + k.index_select(0, rows[j]).float() * e
    return num / den


def compress_pools_extend(
    k: torch.Tensor,
    gates: torch.Tensor,
    ape: torch.Tensor,
    pool_tok_start: torch.Tensor,
) -> torch.Tensor:
    """Pool keys in serving's "extend" order (the online-softmax recurrence), FP32: how
    serving compresses a pool closed by a prefill forward (contract §6 step 1).

    Args: as :func:`compress_pools_decode`.

    Returns:
        ``[P, D]``, float32: with ``s_j`` as there and ``m = -inf``, ``den = acc = 0``, for
        each slot ``j = 0..K-1`` in order, every operation rounded to FP32 on its own (no
        FMA): ``m' = max(m, s_j)``, ``r = exp(m - m')``, ``p = exp(s_j - m')``,
        ``den = den * r + p``, ``acc = acc * r + k[t_j].float() * p``, ``m = m'``; then
        ``acc / den`` (correctly rounded division).
    """
    return _compress(k, gates, ape, pool_tok_start, _extend_order)


def _extend_order(k, rows, logits):
    m = torch.full_like(logits[0], -math.inf)
    den = torch.zeros_like(m)
    acc = torch.zeros_like(m)
    for j in range(len(rows)):
        m_new = torch.maximum(m, logits[j])
        r = torch.exp(m - m_new)
        p = torch.exp(logits[j] - m_new)
        den = den * r + p
        acc = acc * r + k.index_select(0, rows[j]).float() * p
        m = m_new
    return acc / den


def compress_pools_serving(k, gates, ape, pool_tok_start, extend: torch.Tensor | None = None) -> torch.Tensor:
    """Serving's compression with the order chosen per pool: ``extend [P]`` bool (on
    ``k.device``; ``True``: :func:`compress_pools_extend`, ``False``:
    :func:`compress_pools_decode`), or ``None``: every pool in decode order. ``[P, D]`` float32."""
    pooled = compress_pools_decode(k, gates, ape, pool_tok_start)
    if extend is None:
        return pooled
    extend = check_is_tensor("extend", extend)
    check_dtype("extend", extend, torch.bool)
    check_dim("extend", extend, 0, pool_tok_start.shape[0], "P of pool_tok_start")
    check_device("extend", extend, k.device)
    return torch.where(extend[:, None], compress_pools_extend(k, gates, ape, pool_tok_start), pooled)


def prepare_pools_bf16_serving(
    k: torch.Tensor,
    gates: torch.Tensor,
    ape: torch.Tensor,
    pool_tok_start: torch.Tensor,
    extend: torch.Tensor | None = None,
) -> torch.Tensor:
    """Serving pool keys stored in BF16, no rotation (the BF16 serving arm).

    Args: as :func:`compress_pools_serving` (``extend``: the pools compressed in extend
    order; ``None``: all in decode order).

    Returns:
        ``[P, D]``, bfloat16: ``compress_pools_serving(...).to(torch.bfloat16)``.
    """
    return compress_pools_serving(k, gates, ape, pool_tok_start, extend).to(torch.bfloat16)


def prepare_pools_fp8(
    k: torch.Tensor,
    gates: torch.Tensor,
    ape: torch.Tensor,
    pool_tok_start: torch.Tensor,
    extend: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 pool keys as serving stores them (contract §6 step 1 to §6 step 4).

    Args: as :func:`compress_pools_serving` (``extend``: the pools compressed in extend
    order; ``None``: all in decode order).

    Returns:
        k8: ``[P, D]``, float8_e4m3fn; k_scale: ``[P]``, float32. Steps:
        ``compress_pools_serving`` -> ``.to(bfloat16).float()`` -> :func:`hadamard` ->
        ``.to(bfloat16)`` -> :func:`quantize_e4m3` along ``D``. ``D`` must be a power of two.
    """
    pooled = compress_pools_serving(k, gates, ape, pool_tok_start, extend)
    check_power_of_two("k", pooled.shape[-1])
    with _fp32_region(pooled.device):
        rotated = hadamard(pooled.to(torch.bfloat16).float()).to(torch.bfloat16).float()
        return quantize_e4m3(rotated, dim=-1)


# -------------------------------------------------------------------------- queries


def prepare_queries_fp8(
    q: torch.Tensor, head_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 queries and folded head weights as serving feeds DeepGEMM (contract §6 step 5, §6 step 6).

    Args:
        q: ``[S, H, D]``, any float dtype; index queries. ``D`` must be a power of two.
        head_weights: ``[S, H]``, any float dtype; the per-head gate ``w``.

    Returns:
        q8: ``[S, H, D]``, float8_e4m3fn: ``hadamard(q.float())`` rounded to BF16, then
            :func:`quantize_e4m3` with one scale per (row, head).
        weights: ``[S, H]``, float32: ``weight'[t, h]``, computed left to right with every
            product rounded to FP32 (the order of DeepSeek-V3.2's indexer):
            ``((w.float() * fp32(H^-0.5)) * q_scale) * fp32(D^-0.5)``. ``q_scale`` is a
            power of two, so its product is exact barring under/overflow.
    """
    q = check_is_tensor("q", q)
    head_weights = check_is_tensor("head_weights", head_weights)
    check_float_dtype("q", q)
    check_float_dtype("head_weights", head_weights)
    check_ndim("q", q, 3, "[S, H, D]")
    check_ndim("head_weights", head_weights, 2, "[S, H]")
    s_tok, heads, d = q.shape
    if head_weights.shape != (s_tok, heads):
        raise ValueError(
            f"head_weights: expected shape {(s_tok, heads)} ([S, H] of q), "
            f"got {tuple(head_weights.shape)}"
        )
    check_device("head_weights", head_weights, q.device)
    check_power_of_two("q", d)
    with _fp32_region(q.device):
        rotated = hadamard(q.float()).to(torch.bfloat16).float()
        q8, q_scale = quantize_e4m3(rotated, dim=-1)
        weights = head_weights.float() * _inv_sqrt_fp32(heads)
        weights = weights * q_scale
        weights = weights * _inv_sqrt_fp32(d)
        return q8, weights
