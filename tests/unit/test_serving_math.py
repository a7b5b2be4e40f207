"""FP8 serving arithmetic (contract §6) against independent step-by-step references.

Nothing here calls one ``sp_kpool.serving`` helper to check another: the references are
written from the contract (docs/contract.md) with NumPy scalar/column loops (FP32 butterflies, UE8M0 by a
loop over powers of two, E4M3 and BF16 rounding from their bit layouts, per-pool
compression loops) or in float64. FP8 values and scales are compared bitwise.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sp_kpool import serving, serving_scores

# ---------------------------------------------------------------- constants

#: FP32 unit roundoff.
U32 = 2.0**-24
#: Decode compression vs a float64 softmax: FP32 exp (<= 1 ulp), K sequential adds and one
#: division give a few 1e-7 on keys in [-1, 1]; the contract asks for 1e-6.
COMPRESS_TOL = 1e-6
#: Smallest UE8M0 scale: fp32(1e-4) / 448 ~ 2.23e-7 rounds up to 2^-22.
MIN_SCALE = 2.0**-22


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _f32(v: float) -> np.float32:
    return np.float32(v)


# --------------------------------------------------- independent references


def sylvester(d: int) -> np.ndarray:
    """``[d, d]`` float64 Hadamard matrix by Sylvester's construction."""
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


def fwht_fp32_loops(x: np.ndarray) -> np.ndarray:
    """``[N, D]`` float32: textbook in-place butterflies (column by column), then * fp32(D^-0.5)."""
    y = np.array(x, dtype=np.float32, copy=True)
    d = y.shape[1]
    h = 1
    while h < d:
        for i in range(0, d, 2 * h):
            for j in range(i, i + h):
                a = y[:, j].copy()
                b = y[:, j + h].copy()
                y[:, j] = a + b
                y[:, j + h] = a - b
        h *= 2
    return (y * _f32(d**-0.5)).astype(np.float32)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest-even BF16, returned as float32 (finite inputs)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def ue8m0_loop(absmax: float) -> float:
    """``max(absmax, fp32 1e-4) / 448`` in FP32, then the smallest power of two >= it."""
    x = np.maximum(_f32(absmax), _f32(1e-4)) / _f32(448.0)
    assert x.dtype == np.float32
    p = 2.0**-40
    while p < float(x):
        p *= 2.0
    return p


def _e4m3_table() -> np.ndarray:
    """Values of the finite non-negative ``float8_e4m3fn`` codes 0..126 (ascending)."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals)


E4M3 = _e4m3_table()


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float32 values with ``|x| <= 448`` -> e4m3fn codes (uint8), nearest, ties to even code."""
    x = np.asarray(x, dtype=np.float32).astype(np.float64)
    a = np.abs(x)
    assert np.all(a <= 448.0)
    hi = np.clip(np.searchsorted(E4M3, a, side="left"), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    d_lo = np.abs(a - E4M3[lo])
    d_hi = np.abs(E4M3[hi] - a)
    code = np.where(d_lo < d_hi, lo, hi)
    tie = d_lo == d_hi
    code = np.where(tie, np.where(lo % 2 == 0, lo, hi), code)
    return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def quantize_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[N, D]`` float32 -> (codes uint8 [N, D], scales float32 [N]), one scale per row."""
    x = np.asarray(x, dtype=np.float32)
    scales = np.array([ue8m0_loop(float(np.max(np.abs(row)))) for row in x], dtype=np.float32)
    scaled = np.clip(x / scales[:, None], _f32(-448.0), _f32(448.0)).astype(np.float32)
    return e4m3_encode(scaled), scales


def compress_ref_fp32(k, gates, ape, starts) -> torch.Tensor:
    """Decode-mode compression, one pool at a time, one slot at a time (FP32)."""
    kp = ape.shape[0]
    out = []
    for start in starts.tolist():
        s = [gates[start + j].float() + ape[j].float() for j in range(kp)]
        m = s[0].clone()
        for j in range(1, kp):
            m = torch.where(s[j] > m, s[j], m)
        den = torch.zeros_like(m)
        num = torch.zeros_like(m)
        for j in range(kp):
            e = torch.exp(s[j] - m)
            den = den + e
            num = num + k[start + j].float() * e
        out.append(num / den)
    return torch.stack(out)


def compress_ref_f64(k, gates, ape, starts) -> torch.Tensor:
    kp = ape.shape[0]
    rows = []
    for start in starts.tolist():
        s = gates[start : start + kp].double() + ape.double()  # [K, D]
        p = torch.softmax(s, dim=0)
        rows.append((p * k[start : start + kp].double()).sum(0))
    return torch.stack(rows)


def pool_starts(doc_lens: list[int], kp: int) -> torch.Tensor:
    """Token id of slot 0 of every complete pool of packed documents."""
    starts, offset = [], 0
    for n in doc_lens:
        starts += [offset + j * kp for j in range(n // kp)]
        offset += n
    return torch.tensor(starts, dtype=torch.int64)


def make_inputs(seed: int, doc_lens=(37, 16, 50, 3), d=128, kp=4, gate_scale=3.0):
    g = _gen(seed)
    s = sum(doc_lens)
    k = torch.randn(s, d, generator=g).to(torch.bfloat16)
    k[4:8] = 0  # pool 1 of document 0 is all zeros -> floor scale, zero codes
    gates = (torch.randn(s, d, generator=g) * gate_scale).to(torch.bfloat16)
    ape = torch.randn(kp, d, generator=g)
    return k, gates, ape, pool_starts(list(doc_lens), kp)


def codes(t: torch.Tensor) -> np.ndarray:
    assert t.dtype == torch.float8_e4m3fn
    return t.view(torch.uint8).numpy()


# ------------------------------------------------------------------ Hadamard


@pytest.mark.parametrize("d", [1, 2, 8, 64, 128])
def test_hadamard_is_sylvester_matrix(d):
    m = serving.hadamard(torch.eye(d, dtype=torch.float64))
    assert m.dtype == torch.float32
    expected = torch.from_numpy(sylvester(d)).float() * float(_f32(d**-0.5))
    assert torch.equal(m, expected)  # +-fp32(D^-0.5) exactly
    h = sylvester(d)
    assert np.array_equal(h @ h.T, d * np.eye(d))
    mm = m.double() @ m.double().T
    assert torch.allclose(mm, torch.eye(d, dtype=torch.float64), rtol=0, atol=1e-6)


def test_hadamard_matches_float64_and_preserves_dots():
    d = 128
    x = torch.randn(6, 3, d, generator=_gen(1), dtype=torch.float32)
    y = serving.hadamard(x.to(torch.bfloat16))
    ref = x.to(torch.bfloat16).double() @ torch.from_numpy(sylvester(d)).T / math.sqrt(d)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert (y.double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item()
    a, b = x[:, 0].double(), x[:, 1].double()
    ya, yb = serving.hadamard(x[:, 0]).double(), serving.hadamard(x[:, 1]).double()
    dots, rdots = (ya * yb).sum(-1), (a * b).sum(-1)
    norms = a.norm(dim=-1) * b.norm(dim=-1)
    assert ((dots - rdots).abs() / norms).max().item() < 1e-6


def test_hadamard_bitwise_equals_butterfly_loops():
    x = torch.randn(40, 128, generator=_gen(2)) * 10
    y = serving.hadamard(x)
    ref = fwht_fp32_loops(x.numpy())
    assert np.array_equal(y.numpy().view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("d", [0, 3, 96, 130])
def test_hadamard_rejects_non_power_of_two(d):
    with pytest.raises(ValueError, match=rf"power of two.*\b{d}\b"):
        serving.hadamard(torch.zeros(2, d))


# ------------------------------------------------------------------- UE8M0


def test_ue8m0_exact_powers_stay():
    ks = list(range(-22, 31))
    absmax = torch.tensor([448.0 * 2.0**k for k in ks], dtype=torch.float32)
    got = serving.ue8m0_scale(absmax)
    assert got.dtype == torch.float32
    assert got.tolist() == [2.0**k for k in ks]
    above = torch.nextafter(absmax, torch.full_like(absmax, math.inf))
    assert serving.ue8m0_scale(above).tolist() == [2.0 ** (k + 1) for k in ks]
    below = torch.nextafter(absmax, torch.zeros_like(absmax))
    got_below = serving.ue8m0_scale(below).tolist()
    assert got_below[1:] == [2.0**k for k in ks[1:]]
    assert got_below[0] == MIN_SCALE  # 448 * 2^-22 - ulp < ... still above the floor / 448


def test_ue8m0_floor_and_specials():
    tiny = torch.tensor([0.0, 1e-30, 1e-5, 9.9e-5, 1e-4, 448 * 2.0**-23], dtype=torch.float32)
    assert serving.ue8m0_scale(tiny).tolist() == [MIN_SCALE] * 6
    assert _f32(1e-4) / _f32(448) > 2.0**-23  # why the floor lands on 2^-22
    sp = serving.ue8m0_scale(torch.tensor([math.inf, math.nan, -3.0]))
    assert sp[0].item() == math.inf and math.isnan(sp[1].item()) and sp[2].item() == MIN_SCALE


def test_ue8m0_random_bit_patterns_match_loop():
    g = _gen(3)
    # Positive finite FP32 bit patterns over the whole exponent range (up to 2^127).
    bits = torch.randint(0, 0x7F000000, (1500,), generator=g, dtype=torch.int32)
    absmax = bits.view(torch.float32)
    got = serving.ue8m0_scale(absmax).tolist()
    assert got == [ue8m0_loop(a) for a in absmax.tolist()]
    bf = absmax.to(torch.bfloat16)
    assert torch.equal(serving.ue8m0_scale(bf), serving.ue8m0_scale(bf.float()))


# ------------------------------------------------------------- quantization


def test_quantize_e4m3_matches_reference_bitwise():
    g = _gen(4)
    mags = 2.0 ** torch.randint(-30, 30, (64, 1), generator=g).float()
    x = torch.randn(64, 128, generator=g) * mags
    x[3] = 0.0  # zero vector
    x[4] = -x[4].abs()  # all negative
    x[5, 7] = 448.0 * 2.0**-3  # absmax exactly on a power of two
    x[5] = x[5].clamp(-448.0 * 2.0**-3, 448.0 * 2.0**-3)
    x[6] = -x[5]
    x = x.to(torch.bfloat16).float()  # serving quantizes BF16-rounded values
    v, s = serving.quantize_e4m3(x)
    assert v.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (64,)
    rc, rs = quantize_ref(x.numpy())
    assert np.array_equal(s.numpy(), rs)
    assert np.array_equal(codes(v), rc)
    # edge rows
    assert s[3].item() == MIN_SCALE and not codes(v)[3].any()
    assert s[5].item() == 2.0**-3 and codes(v)[5, 7] == 0x7E  # +448 exactly, the clamp edge
    assert codes(v)[6, 7] == 0xFE  # -448
    assert np.all(codes(v)[4] >= 0x80)  # sign bit set on every value
    deq = v.float() * s[:, None]
    assert deq.abs().max(dim=1).values.le(448.0 * s).all()


def test_quantize_e4m3_dim_and_bf16_input():
    x = torch.randn(5, 32, 3, generator=_gen(5)).to(torch.bfloat16)
    v, s = serving.quantize_e4m3(x, dim=1)
    assert v.shape == (5, 32, 3) and s.shape == (5, 3)
    flat = x.float().permute(0, 2, 1).reshape(-1, 32).numpy()
    rc, rs = quantize_ref(flat)
    assert np.array_equal(codes(v.permute(0, 2, 1).contiguous()).reshape(-1, 32), rc)
    assert np.array_equal(s.reshape(-1).numpy(), rs)


def test_e4m3_reference_encoder_agrees_with_torch_cast():
    # Guards the independent encoder itself: every representable value, every midpoint.
    vals = np.concatenate([E4M3, (E4M3[1:] + E4M3[:-1]) / 2, [2.0**-10, 1e-12]])
    vals = np.concatenate([vals, -vals]).astype(np.float32)
    t = torch.from_numpy(vals).to(torch.float8_e4m3fn)
    assert np.array_equal(codes(t), e4m3_encode(vals))


# --------------------------------------------------------------- compression


def test_compress_decode_equals_per_pool_loop_bitwise():
    k, gates, ape, starts = make_inputs(6)
    got = serving.compress_pools_decode(k, gates, ape, starts)
    assert got.dtype == torch.float32 and got.shape == (starts.numel(), 128)
    ref = compress_ref_fp32(k, gates, ape, starts)
    assert torch.equal(got, ref)
    bf = serving.prepare_pools_bf16_serving(k, gates, ape, starts)
    assert bf.dtype == torch.bfloat16
    expected_bits = bf16_round(ref.numpy()).view(np.uint32)
    assert np.array_equal(bf.float().numpy().view(np.uint32), expected_bits)


def test_compress_decode_large_gates_vs_float64_softmax():
    g = _gen(7)
    s, d, kp = 64, 32, 4
    k = torch.rand(s, d, generator=g) * 2 - 1
    # Multiples of 1/8 up to +-1000 are exact in FP32, so g + ape is exact and the
    # comparison isolates the softmax arithmetic; exp(1000) overflows a naive softmax.
    gates = torch.round(torch.randn(s, d, generator=g) * 400 * 8) / 8
    ape = torch.round(torch.randn(kp, d, generator=g) * 8) / 8
    starts = torch.arange(0, s, kp)
    got = serving.compress_pools_decode(k, gates, ape, starts)
    assert torch.isfinite(got).all()
    ref = compress_ref_f64(k, gates, ape, starts)
    assert (got.double() - ref).abs().max().item() <= COMPRESS_TOL
    # One slot dominating every channel -> that slot's key, exactly.
    gates2 = torch.zeros(s, d)
    gates2[2::kp] = 1e4
    dom = serving.compress_pools_decode(k, gates2, torch.zeros(kp, d), starts)
    assert torch.equal(dom, k[2::kp])


def test_compress_decode_validation():
    k, gates, ape, starts = make_inputs(8, doc_lens=(16,), d=8)
    with pytest.raises(ValueError, match="pool_tok_start.*13"):
        serving.compress_pools_decode(k, gates, ape, torch.tensor([0, 13]))
    with pytest.raises(ValueError, match="pool_tok_start"):
        serving.compress_pools_decode(k, gates, ape, torch.tensor([-1]))
    with pytest.raises(TypeError, match="pool_tok_start.*int64.*int32"):
        serving.compress_pools_decode(k, gates, ape, starts.int())
    with pytest.raises(ValueError, match="gates"):
        serving.compress_pools_decode(k, gates[:, :4], ape, starts)
    with pytest.raises(ValueError, match="ape"):
        serving.compress_pools_decode(k, gates, ape[:, :4], starts)
    empty = serving.compress_pools_decode(k, gates, ape, torch.zeros(0, dtype=torch.int64))
    assert empty.shape == (0, 8) and empty.dtype == torch.float32


# ------------------------------------------------------------ FP8 pipeline


def test_prepare_pools_fp8_bitwise():
    k, gates, ape, starts = make_inputs(9)
    k8, ks = serving.prepare_pools_fp8(k, gates, ape, starts)
    assert k8.dtype == torch.float8_e4m3fn and k8.shape == (starts.numel(), 128)
    assert ks.dtype == torch.float32 and ks.shape == (starts.numel(),)
    pooled = compress_ref_fp32(k, gates, ape, starts).numpy()
    rotated = bf16_round(fwht_fp32_loops(bf16_round(pooled)))
    rc, rs = quantize_ref(rotated)
    assert np.array_equal(ks.numpy(), rs)
    assert np.array_equal(codes(k8), rc)
    assert ks[1].item() == MIN_SCALE and not codes(k8)[1].any()  # the all-zero pool


def test_prepare_queries_fp8_bitwise():
    s, h, d = 24, 8, 128  # neither H^-0.5 nor D^-0.5 is a power of two: order matters
    g = _gen(10)
    mags = 2.0 ** torch.randint(-8, 8, (s, h, 1), generator=g)
    q = (torch.randn(s, h, d, generator=g) * mags).to(torch.bfloat16)
    w = torch.randn(s, h, generator=g).to(torch.bfloat16)
    q8, wp = serving.prepare_queries_fp8(q, w)
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == (s, h, d)
    assert wp.dtype == torch.float32 and wp.shape == (s, h)
    rotated = bf16_round(fwht_fp32_loops(q.float().reshape(-1, d).numpy()))
    rc, rs = quantize_ref(rotated)
    assert np.array_equal(codes(q8).reshape(-1, d), rc)
    w32 = w.float().numpy().reshape(-1)
    ref_w = ((w32 * _f32(h**-0.5)) * rs) * _f32(d**-0.5)
    assert ref_w.dtype == np.float32
    assert np.array_equal(wp.numpy().reshape(-1), ref_w)


# ------------------------------------------------------------------ scoring


def _accum_bound(terms: torch.Tensor, n: int) -> torch.Tensor:
    """A priori FP32 summation error bound ``~ n * u * sum|terms|`` (with slack)."""
    return (n + 4) * U32 * terms


def test_mqa_logits_reference_vs_float64():
    s, h, d, p = 40, 8, 128, 72
    k, gates, ape, _ = make_inputs(11, doc_lens=(4 * p,), d=d)
    k8, ks = serving.prepare_pools_fp8(k, gates, ape, torch.arange(0, 4 * p, 4))
    g = _gen(12)
    q = torch.randn(s, h, d, generator=g)
    q8, wp = serving.prepare_queries_fp8(q, torch.randn(s, h, generator=g))
    got = serving_scores.mqa_logits_fp8_reference(q8, wp, k8, ks, chunk_rows=7)
    assert got.dtype == torch.float32 and got.shape == (s, p)
    qd, kd = q8.double(), k8.double()
    dots = torch.einsum("thd,pd->thp", qd, kd)
    ref = ks.double()[None] * (dots.relu() * wp.double()[:, :, None]).sum(1)
    absdots = torch.einsum("thd,pd->thp", qd.abs(), kd.abs())
    mag = ks.double()[None] * (absdots * wp.double().abs()[:, :, None]).sum(1)
    err = (got.double() - ref).abs()
    assert (err <= _accum_bound(mag, d + h)).all()
    again = serving_scores.mqa_logits_fp8_reference(q8, wp, k8, ks, chunk_rows=7)
    assert torch.equal(got, again)  # deterministic
    full = serving_scores.mqa_logits_fp8_reference(q8, wp, k8, ks)
    assert ((full.double() - ref).abs() <= _accum_bound(mag, d + h)).all()


def test_scores_bf16_serving_vs_float64_and_fp8_arm():
    s, h, d, p = 32, 8, 128, 48
    k, gates, ape, _ = make_inputs(13, doc_lens=(4 * p,), d=d)
    starts = torch.arange(0, 4 * p, 4)
    pools = serving.prepare_pools_bf16_serving(k, gates, ape, starts)
    g = _gen(14)
    q = torch.randn(s, h, d, generator=g).to(torch.bfloat16)
    w = torch.randn(s, h, generator=g).to(torch.bfloat16)
    got = serving_scores.scores_bf16_serving(q, w, pools, chunk_rows=5)
    assert got.dtype == torch.float32 and got.shape == (s, p)
    qd, pd = q.double(), pools.double()
    dots = torch.einsum("thd,pd->thp", qd, pd)
    wd = w.double() * h**-0.5
    ref = (wd[:, :, None] * (dots * d**-0.5).relu()).sum(1)
    mag = (wd.abs()[:, :, None] * torch.einsum("thd,pd->thp", qd.abs(), pd.abs()) * d**-0.5).sum(1)
    assert ((got.double() - ref).abs() <= _accum_bound(mag, d + h + 4)).all()
    # The FP8 arm scores the same pools after a rotation: close, not equal (contract §6).
    k8, ks = serving.prepare_pools_fp8(k, gates, ape, starts)
    q8, wp = serving.prepare_queries_fp8(q, w)
    fp8 = serving_scores.mqa_logits_fp8_reference(q8, wp, k8, ks).double()
    diff = 1 - 2 * (fp8 * ref).sum() / ((fp8 * fp8) + (ref * ref)).sum()
    assert diff.item() < 2e-3


# ------------------------------------------------ FP32 regardless of context


def _all_outputs() -> list[torch.Tensor]:
    k, gates, ape, starts = make_inputs(15, doc_lens=(64,), d=64)
    g = _gen(16)
    q = torch.randn(20, 8, 64, generator=g)
    w = torch.randn(20, 8, generator=g)
    pools = serving.prepare_pools_bf16_serving(k, gates, ape, starts)
    k8, ks = serving.prepare_pools_fp8(k, gates, ape, starts)
    q8, wp = serving.prepare_queries_fp8(q, w)
    v, sc = serving.quantize_e4m3(q[:, 0])
    return [
        serving.hadamard(q),
        serving.ue8m0_scale(w.abs()),
        v,
        sc,
        serving.compress_pools_decode(k, gates, ape, starts),
        pools,
        k8,
        ks,
        q8,
        wp,
        serving_scores.mqa_logits_fp8_reference(q8, wp, k8, ks, chunk_rows=6),
        serving_scores.scores_bf16_serving(q, w, pools, chunk_rows=6),
    ]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.dtype == y.dtype and x.shape == y.shape, i
        if x.dtype == torch.float8_e4m3fn:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(x, y), i


def test_cpu_autocast_and_matmul_precision_change_nothing():
    plain = _all_outputs()
    assert plain[-1].dtype == torch.float32 and plain[-2].dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = _all_outputs()
    _same(plain, auto)
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        low = _all_outputs()
        assert torch.get_float32_matmul_precision() == "medium"  # restored after each call
    finally:
        torch.set_float32_matmul_precision(previous)
    _same(plain, low)


# --------------------------------------------------------------- validation


def test_scoring_validation_names_the_argument():
    q8 = torch.zeros(4, 2, 8).to(torch.float8_e4m3fn)
    k8 = torch.zeros(3, 8).to(torch.float8_e4m3fn)
    w = torch.zeros(4, 2)
    ks = torch.ones(3)
    msg = r"k8: expected dtype torch.float8_e4m3fn, got torch.float32"
    with pytest.raises(TypeError, match=msg):
        serving_scores.mqa_logits_fp8_reference(q8, w, k8.float(), ks)
    with pytest.raises(ValueError, match=r"weights: expected shape \(4, 2\).*\(4, 3\)"):
        serving_scores.mqa_logits_fp8_reference(q8, torch.zeros(4, 3), k8, ks)
    with pytest.raises(ValueError, match="k_scale"):
        serving_scores.mqa_logits_fp8_reference(q8, w, k8, torch.ones(2))
    with pytest.raises(ValueError, match="chunk_rows"):
        serving_scores.mqa_logits_fp8_reference(q8, w, k8, ks, chunk_rows=0)
    with pytest.raises(ValueError, match="head_weights"):
        serving.prepare_queries_fp8(torch.zeros(4, 2, 8), torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"q: expected the last dim to be a power of two, got 12"):
        serving.prepare_queries_fp8(torch.zeros(4, 2, 12), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="pools_bf16"):
        serving_scores.scores_bf16_serving(torch.zeros(4, 2, 8), w, torch.zeros(3, 16))


def test_serving_argument_errors_name_the_argument():
    """The serving references check their arguments with :mod:`sp_kpool.checks` (one place
    for argument checks); the messages name the argument, the expected and the actual value."""
    f32, i64 = torch.zeros(4, 8), torch.zeros(2, dtype=torch.int64)
    cases = [
        (lambda: serving.hadamard([1.0]), TypeError, "x: expected a torch.Tensor, got list"),
        (lambda: serving.hadamard(torch.zeros(4, 8, dtype=torch.int32)), TypeError,
         "x: expected dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16), got torch.int32"),
        (lambda: serving.hadamard(torch.zeros(4, 6)), ValueError, "x: expected the last dim to be a power of two, got 6"),
        (lambda: serving.compress_pools_serving(f32, f32, torch.zeros(4, 8), i64.int()), TypeError,
         "pool_tok_start: expected dtype torch.int64, got torch.int32"),
        (lambda: serving.compress_pools_serving(f32[0], f32, torch.zeros(4, 8), i64), ValueError,
         "k: expected 2 dims [S, D], got shape (8,)"),
        (lambda: serving.compress_pools_serving(f32, f32, torch.zeros(4, 6), i64), ValueError,
         "ape: expected size 8 (D) at dim 1, got shape (4, 6)"),
        (lambda: serving.compress_pools_serving(f32, f32, torch.zeros(4, 8, device="meta"), i64), ValueError,
         "ape: expected device cpu, got meta"),
        (lambda: serving_scores.mqa_logits_fp8_reference(
            torch.zeros(2, 1, 8).to(torch.float8_e4m3fn), torch.zeros(2, 1), torch.zeros(3, 8).to(torch.float8_e4m3fn),
            torch.zeros(3), chunk_rows=0), ValueError, "chunk_rows: expected a positive int, got 0"),
    ]  # fmt: skip
    for call, exc, text in cases:
        with pytest.raises(exc) as info:
            call()
        assert str(info.value) == text
