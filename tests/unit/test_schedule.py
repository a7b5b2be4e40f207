"""The serving compression schedule (``prompt_lens``): extend order for the pools closed in
the prompt's prefill, decode order for the others, against an independent NumPy reference.

* NumPy step-by-step recurrences of both orders (one FP32 operation per line) and of the
  BF16 / Hadamard / UE8M0 / E4M3 steps, bitwise against :mod:`sp_kpool.serving`.
* The schedule rule ``(p + 1) * K <= P_d`` at pool boundaries (``extend_pools`` against a
  loop over (document, pool), and through ``kpool_topk``).
* Inputs crafted (deterministically) so that the two orders give different BF16 / FP8
  pools *and* different selections: ``kpool_topk`` with a schedule must select what the
  NumPy reference with the schedule selects, and not what all-decode selects.
* ``bf16`` ignores the schedule; bad ``prompt_lens`` raise; 2/3/4 gloo ranks equal world
  size 1 with a schedule; the Triton kernels (``schedule_interp_cases.py``, interpreter).

Exp: NumPy's FP32 ``exp`` and torch's CPU ``exp`` differ in the last bit on about a third
of the arguments (checked: numpy 2.4 / torch 2.14), and the library's contract is
"``exp`` is the backend's ``torch.exp``". The reference therefore calls ``torch.exp`` on
a float32 tensor for ``exp`` only (:func:`exp32`); every other operation is NumPy FP32.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from sp_kpool import ShardedSequence, kpool_topk, serving
from sp_kpool.pooling import extend_pools, pool_table
from sp_kpool.testing.dist import run_ranks
from sp_kpool.testing.problems import GlobalInputs, shard_inputs

K = 4
F32 = np.float32

# ----------------------------------------------------------- NumPy reference


def exp32(x: np.ndarray) -> np.ndarray:
    """FP32 ``exp`` as torch's CPU kernel computes it (see the module docstring)."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=F32)).exp().numpy()


def slot_logits(k, gates, ape, starts):
    """``(k_j [K, P, D], s_j [K, P, D])`` float32: per slot the keys and ``f32(g) + f32(ape_j)``."""
    k = np.asarray(k, dtype=F32)
    gates = np.asarray(gates, dtype=F32)
    ape = np.asarray(ape, dtype=F32)
    starts = np.asarray(starts, dtype=np.int64)
    kj = np.stack([k[starts + j] for j in range(ape.shape[0])])
    sj = np.stack([gates[starts + j] + ape[j][None, :] for j in range(ape.shape[0])])
    return kj, sj


def np_decode(kj: np.ndarray, sj: np.ndarray) -> np.ndarray:
    """Decode order: ``m = max_j s_j``; ``e = exp(s_j - m)``, ``den += e``, ``num += k_j * e``."""
    m = sj[0]
    for j in range(1, sj.shape[0]):
        m = np.maximum(m, sj[j])
    den = np.zeros_like(m)
    num = np.zeros_like(m)
    for j in range(sj.shape[0]):
        d = sj[j] - m
        e = exp32(d)
        den = den + e
        prod = kj[j] * e
        num = num + prod
    return num / den


def np_extend(kj: np.ndarray, sj: np.ndarray) -> np.ndarray:
    """Extend order: the online softmax, every operation rounded to FP32 on its own."""
    m = np.full(sj.shape[1:], -np.inf, dtype=F32)
    den = np.zeros(sj.shape[1:], dtype=F32)
    acc = np.zeros(sj.shape[1:], dtype=F32)
    for j in range(sj.shape[0]):
        m2 = np.maximum(m, sj[j])
        dm = m - m2  # -inf - finite = -inf: exp gives 0
        r = exp32(dm)
        ds = sj[j] - m2
        p = exp32(ds)
        den_r = den * r
        den = den_r + p
        acc_r = acc * r
        kp = kj[j] * p
        acc = acc_r + kp
        m = m2
    return acc / den


def np_serving(k, gates, ape, starts, extend=None) -> np.ndarray:
    """``[P, D]`` float32 pools, per pool the order ``extend[p]`` says (``None``: decode)."""
    kj, sj = slot_logits(k, gates, ape, starts)
    dec = np_decode(kj, sj)
    if extend is None:
        return dec
    ext = np_extend(kj, sj)
    mask = np.asarray(extend, dtype=bool)[:, None]
    return np.where(mask, ext, dec).astype(F32)


def np_bf16(x: np.ndarray) -> np.ndarray:
    """FP32 -> BF16 (round to nearest even, from the bit layout) -> FP32. No NaN inputs."""
    b = np.ascontiguousarray(x, dtype=F32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(F32)


def np_hadamard(x: np.ndarray) -> np.ndarray:
    """Butterflies ``h = 1, 2, ..., D/2`` on columns (FP32), then ``* fp32(D^-0.5)``."""
    y = np.array(x, dtype=F32, copy=True)
    d = y.shape[-1]
    h = 1
    while h < d:
        for i in range(0, d, 2 * h):
            for j in range(i, i + h):
                a = y[..., j].copy()
                b = y[..., j + h].copy()
                y[..., j] = a + b
                y[..., j + h] = a - b
        h *= 2
    return y * F32(float(d) ** -0.5)


def np_ue8m0(amax: np.ndarray) -> np.ndarray:
    """``max(amax, fp32(1e-4)) / 448`` (FP32), rounded up to a power of two by ``frexp``."""
    s = np.maximum(np.asarray(amax, dtype=F32), F32(1e-4)) / F32(448.0)
    mant, e = np.frexp(s)  # s = mant * 2^e, mant in [0.5, 1)
    up = np.ldexp(np.ones_like(s), e)
    return np.where(mant == 0.5, s, up).astype(F32)


def np_fp8(pooled: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(k8 [P, D] uint8 bits of float8_e4m3fn, scale [P] float32)`` of FP32 pools."""
    x = np_bf16(np_hadamard(np_bf16(pooled)))
    scale = np_ue8m0(np.abs(x).max(axis=-1))
    v = np.clip(x / scale[:, None], F32(-448.0), F32(448.0)).astype(F32)
    k8 = torch.from_numpy(v).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    return k8, scale


def np_fp8_dequant(k8: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return torch.from_numpy(k8).view(torch.float8_e4m3fn).double().numpy() * scale[:, None].astype(np.float64)


def loop_extend(lengths, prompts, kpool):
    """The rule, pool by pool: pool ``p`` of document ``d`` is extend iff ``(p + 1) * K <= P_d``."""
    out = []
    for n, pr in zip(lengths, prompts):
        for p in range(n // kpool):
            out.append((p + 1) * kpool <= pr)
    return out


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def bits(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}[t.dtype]
    return t.view(view).numpy()


# --------------------------------------------------- crafted differing pools


def craft_pools(seed: int, d: int, count: int, fp8: bool, ape: np.ndarray | None = None):
    """``count`` pools (``k``, ``gates`` ``[count * K, d]``, the shared ``ape [K, d]``)
    whose decode and extend orders give different BF16 pools (``fp8``: different FP8 values
    or scales too). Deterministic: a NumPy generator from ``seed``.

    How: random slots with moderate gates (the FP32 results of the two orders differ in
    the last bit for about a sixth of the channels), then in every channel the last
    slot's key is moved so that the pooled value lands next to a BF16 rounding midpoint,
    and scanned over 513 consecutive FP32 values (all channels at once) until the two
    orders round to different BF16 somewhere."""
    rng = np.random.default_rng(seed)
    if ape is None:
        ape = (rng.standard_normal((K, d)) * 0.5).astype(F32)
    ks, gs = [], []
    tries = 0
    steps = np.arange(-256, 257, dtype=np.int32)
    while len(ks) < count:
        tries += 1
        assert tries < 200, "craft_pools: no differing pool found"
        g = rng.standard_normal((K, d)).astype(F32)
        kk = rng.standard_normal((K, d)).astype(F32)
        kj, sj = slot_logits(kk, g, ape, np.array([0]))
        r0 = np_decode(kj, sj)[0].astype(np.float64)
        s64 = sj[:, 0].astype(np.float64)
        e = np.exp(s64 - s64.max(axis=0))
        w3 = e[K - 1] / e.sum(axis=0)
        b = np_bf16(r0.astype(F32)).astype(np.float64)
        ulp_b = 2.0 ** (np.floor(np.log2(np.abs(b))) - 7)  # BF16 spacing at b (b != 0)
        mid = b + np.where(r0 >= b, ulp_b / 2, -ulp_b / 2)
        base = np.where(w3 > 0.15, kk[K - 1] + (mid - r0) / np.maximum(w3, 0.15), kk[K - 1]).astype(F32)
        cand = (base.view(np.int32)[None, :] + steps[:, None]).view(F32)  # [513, d] neighbours
        n = cand.shape[0]
        kb = np.repeat(kk[None], n, 0)
        kb[:, K - 1] = cand
        gb = np.repeat(g[None], n, 0)
        kj, sj = slot_logits(kb.reshape(n * K, d), gb.reshape(n * K, d), ape, np.arange(0, n * K, K))
        dec, ext = np_decode(kj, sj), np_extend(kj, sj)
        hits = np.flatnonzero((np_bf16(dec) != np_bf16(ext)).any(axis=1))
        if fp8 and hits.size:
            (a8, a_s), (b8, b_s) = np_fp8(dec[hits]), np_fp8(ext[hits])
            hits = hits[(a8 != b8).any(axis=1) | (a_s != b_s)]
        if hits.size:
            i = int(hits[0])
            ks.append(kb[i])
            gs.append(gb[i])
    return np.concatenate(ks), np.concatenate(gs), ape


def _pool_vector(k4, g4, ape, precision, order_extend):
    """The stored pool of one crafted pool in one order: BF16 values (as float64) or the
    dequantized rotated FP8 values."""
    kj, sj = slot_logits(k4, g4, ape, np.array([0]))
    pooled = np_extend(kj, sj) if order_extend else np_decode(kj, sj)
    if precision == "fp8":
        return np_fp8_dequant(*np_fp8(pooled))[0]
    return np_bf16(pooled)[0].astype(np.float64)


@functools.lru_cache(maxsize=None)
def crafted_problem(precision: str, d: int = 16, seed: int = 3):
    """``(GlobalInputs, prompt_lens, meta)`` (H = 1, D = ``d``, K = 4, FP32) whose selection
    depends on the schedule.

    Documents 0 and 4 (14 tokens each, pools B, A, X; prompts 8 and 7: A extend in 0, decode in 4): A is a
    crafted pool (its stored value differs between the orders at a channel ``c``); B is a
    one-hot pool (gates +-60: both orders give its slot-0 key exactly) holding A's stored
    vector of the order in which A scores lower, so B ties A there (the lower id, B, wins)
    and loses to A in the other; X one-hot and far above both. Rows 11..13 of these
    documents select 2 pools: X and B (A's lower order) or X and A. The queries are one-hot
    in the stored domain (``bf16-serving``: ``+-e_c``; ``fp8``: ``+-H[c] * D^-0.5``, whose
    rotation is ``+-e_c``), head weights 1, so every score is exact in FP32 whatever the
    summation order. Documents 1..3: random keys and gates, random one-hot queries, prompts
    mid-pool, a 3-token document, full. Document 4 sits on the last rank of a split."""
    fp8 = precision == "fp8"
    kc, gc, ape = craft_pools(seed, d, 2, fp8)
    rng = np.random.default_rng(seed + 100)
    lengths = [14, 13, 3, 9, 14]
    cu = _cu(lengths)
    S = cu[-1]
    k = rng.standard_normal((S, d)).astype(F32)
    gates = rng.standard_normal((S, d)).astype(F32)
    chan = rng.integers(d, size=S)
    sign = np.where(rng.random(S) < 0.5, -1.0, 1.0)
    had = np.array([[(-1.0) ** bin(i & j).count("1") for j in range(d)] for i in range(d)])
    hot = np.where(np.arange(K)[:, None] == 0, 60.0, -60.0).astype(F32) * np.ones((1, d), F32)
    for i, t0 in enumerate((cu[0], cu[4])):
        ka, ga = kc[i * K : (i + 1) * K], gc[i * K : (i + 1) * K]
        va_dec = _pool_vector(ka, ga, ape, precision, False)
        va_ext = _pool_vector(ka, ga, ape, precision, True)
        c = int(np.flatnonzero(va_dec != va_ext)[0])
        sigma = 1.0 if va_dec[c] + va_ext[c] > 0 else -1.0
        low_extend = sigma * va_ext[c] < sigma * va_dec[c]
        # B's stored vector must equal A's lower-order one: B's key is A's FP32 pool of that
        # order rounded to BF16 (the stored BF16 pool, and what the FP8 path rounds first)
        kj, sj = slot_logits(ka, ga, ape, np.array([0]))
        k[t0 : t0 + 4], gates[t0 : t0 + 4] = rng.standard_normal((K, d)).astype(F32), hot
        k[t0] = np_bf16((np_extend if low_extend else np_decode)(kj, sj)[0])
        k[t0 + 4 : t0 + 8], gates[t0 + 4 : t0 + 8] = ka, ga
        big = sigma * 4.0 * (abs(va_dec[c]) + 1.0)
        if fp8:  # X's rotation is big * e_c
            x_key = (had[c] * big * float(d) ** -0.5).astype(F32)
        else:
            x_key = rng.standard_normal(d).astype(F32)
            x_key[c] = F32(big)
        k[t0 + 8 : t0 + 12], gates[t0 + 8 : t0 + 12] = rng.standard_normal((K, d)).astype(F32), hot
        k[t0 + 8] = x_key
        chan[t0 : t0 + 14], sign[t0 : t0 + 14] = c, sigma
    if fp8:
        q = (had[chan] * sign[:, None] * float(d) ** -0.5).astype(F32)
    else:
        q = (np.eye(d)[chan] * sign[:, None]).astype(F32)
    x = GlobalInputs(
        cu_seq_lens=cu,
        q=torch.from_numpy(q[:, None, :].copy()),
        k=torch.from_numpy(k),
        gates=torch.from_numpy(gates),
        head_weights=torch.ones(S, 1),
        ape=torch.from_numpy(ape),
    )
    return x, (8, 6, 3, 9, 7), dict(chan=chan, sign=sign)


def reference_sets(x: GlobalInputs, prompt_lens, precision, topk, meta):
    """Per row, the selected ids from the NumPy pools (scheduled by the rule) and exact
    float64 scores of the one-hot queries (ties toward the lower pool id)."""
    cu = x.cu_seq_lens
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    starts, offs = pool_table(torch.tensor(cu), K)
    ext = None if prompt_lens is None else np.array(loop_extend(lengths, prompt_lens, K), dtype=bool)
    pooled = np_serving(x.k.numpy(), x.gates.numpy(), x.ape.numpy(), starts.numpy(), ext)
    stored = np_fp8_dequant(*np_fp8(pooled)) if precision == "fp8" else np_bf16(pooled).astype(np.float64)
    sets = []
    for t in range(cu[-1]):
        dd = int(np.searchsorted(cu, t, side="right")) - 1
        j = t - cu[dd]
        lo, n = int(offs[dd]), (j + 1) // K
        score = np.maximum(meta["sign"][t] * stored[lo : lo + n, meta["chan"][t]], 0.0)
        order = sorted(range(n), key=lambda p: (-score[p], p))[: topk // K]
        ids = {int(starts[lo + p]) + s for p in order for s in range(K)}
        ids |= set(range(t - (j + 1) % K + 1, t + 1))
        sets.append(frozenset(ids))
    return sets


def sets_of(out):
    return [frozenset(v for v in row.tolist() if v >= 0) for row in out]


def run1(x, prompt_lens, **opts):
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0, prompt_lens=prompt_lens)
    return kpool_topk(**shard_inputs(x, seq), seq=seq, **opts)


def random_docs(lengths, d, seed, gate_scale):
    """Random FP32 keys / gates / ape of packed documents (NumPy arrays) and the pool table."""
    rng = np.random.default_rng(seed)
    S = sum(lengths)
    k = rng.standard_normal((S, d)).astype(F32)
    g = (rng.standard_normal((S, d)) * gate_scale).astype(F32)
    ape = (rng.standard_normal((K, d)) * 0.5).astype(F32)
    starts, _ = pool_table(torch.tensor(_cu(lengths)), K)
    return k, g, ape, starts


# ================================================================== tests: math


@pytest.mark.parametrize("d, gate_scale, seed", [(16, 1.0, 0), (64, 2.0, 1), (16, 8.0, 2)])
def test_both_orders_bitwise_equal_numpy_recurrences(d, gate_scale, seed):
    lengths = [37, 3, 22, 16]
    k, g, ape, starts = random_docs(lengths, d, seed, gate_scale)
    args = (torch.from_numpy(k), torch.from_numpy(g), torch.from_numpy(ape), starts)
    kj, sj = slot_logits(k, g, ape, starts.numpy())
    dec, ext = np_decode(kj, sj), np_extend(kj, sj)
    assert np.array_equal(bits(serving.compress_pools_decode(*args)), dec.view(np.int32))
    assert np.array_equal(bits(serving.compress_pools_extend(*args)), ext.view(np.int32))
    frac = float((dec != ext).mean())
    assert frac > 0.005, frac  # the orders do differ in FP32
    # a mixed schedule (the rule's mask, and a random one) through every serving entry point
    rng = np.random.default_rng(seed)
    masks = [extend_pools(torch.tensor(_cu(lengths)), [20, 3, 9, 16], K),
             torch.from_numpy(rng.random(starts.numel()) < 0.5)]  # fmt: skip
    for mask in masks:
        want = np_serving(k, g, ape, starts.numpy(), mask.numpy())
        assert np.array_equal(bits(serving.compress_pools_serving(*args, mask)), want.view(np.int32))
        bf = serving.prepare_pools_bf16_serving(*args, mask)
        assert bf.dtype == torch.bfloat16
        assert np.array_equal(bf.float().numpy().view(np.int32), np_bf16(want).view(np.int32))
        assert np.array_equal(bits(bf), bits(torch.from_numpy(want).to(torch.bfloat16)))  # NumPy RNE == torch's
        k8, sc = serving.prepare_pools_fp8(*args, mask)
        w8, wsc = np_fp8(want)
        assert np.array_equal(bits(k8), w8)
        assert np.array_equal(bits(sc), wsc.view(np.int32))
    # None = every pool in decode order, and an all-False mask too
    none = np.zeros(starts.numel(), dtype=bool)
    assert np.array_equal(bits(serving.compress_pools_serving(*args)), dec.view(np.int32))
    assert np.array_equal(bits(serving.compress_pools_serving(*args, torch.from_numpy(none))), dec.view(np.int32))
    assert np.array_equal(bits(serving.compress_pools_serving(*args, torch.from_numpy(~none))), ext.view(np.int32))


@pytest.mark.parametrize("d", [16, 64])
def test_crafted_pools_differ_after_rounding_and_match_numpy(d):
    # pools whose two orders round to different BF16 (and FP8) values: the schedule is
    # visible in what serving stores, and the library stores what the reference does
    k, g, ape = craft_pools(7 + d, d, 5, fp8=True)
    kt, gt, at = torch.from_numpy(k), torch.from_numpy(g), torch.from_numpy(ape)
    starts = torch.arange(0, k.shape[0], K)
    mask = torch.tensor([True, False, True, True, False])
    for ext in (None, mask, ~mask, torch.ones(5, dtype=torch.bool)):
        want = np_serving(k, g, ape, starts.numpy(), None if ext is None else ext.numpy())
        bf = serving.prepare_pools_bf16_serving(kt, gt, at, starts, ext)
        assert np.array_equal(bf.float().numpy().view(np.int32), np_bf16(want).view(np.int32))
        k8, sc = serving.prepare_pools_fp8(kt, gt, at, starts, ext)
        w8, wsc = np_fp8(want)
        assert np.array_equal(bits(k8), w8) and np.array_equal(bits(sc), wsc.view(np.int32))
    dec_bf = serving.prepare_pools_bf16_serving(kt, gt, at, starts)
    ext_bf = serving.prepare_pools_bf16_serving(kt, gt, at, starts, torch.ones(5, dtype=torch.bool))
    assert (bits(dec_bf) != bits(ext_bf)).any(axis=1).all()  # every crafted pool differs
    d8, ds = serving.prepare_pools_fp8(kt, gt, at, starts)
    e8, es = serving.prepare_pools_fp8(kt, gt, at, starts, torch.ones(5, dtype=torch.bool))
    assert ((bits(d8) != bits(e8)).any(axis=1) | (bits(ds) != bits(es))).all()
    # and the mixed mask gives each pool its own order
    mix = serving.prepare_pools_bf16_serving(kt, gt, at, starts, mask)
    assert np.array_equal(bits(mix), np.where(mask.numpy()[:, None], bits(ext_bf), bits(dec_bf)))


# ================================================================= tests: the rule


RULE_CASES = [
    # (lengths, prompt_lens): mid-pool, aligned, 0, full, 1, shorter than K, empty, several
    ([14], [9]), ([14], [8]), ([14], [7]), ([14], [0]), ([14], [14]), ([14], [1]), ([14], [4]), ([14], [3]),
    ([12], [12]), ([12], [11]), ([3], [3]), ([3], [0]), ([0, 5], [0, 5]), ([16, 3, 0, 9, 8], [13, 2, 0, 4, 8]),
    ([1, 7, 21, 4], [1, 7, 20, 3]),
]  # fmt: skip


@pytest.mark.parametrize("lengths, prompts", RULE_CASES)
def test_extend_pools_equals_the_rule_pool_by_pool(lengths, prompts):
    got = extend_pools(torch.tensor(_cu(lengths)), prompts, K)
    assert got.dtype == torch.bool
    assert got.tolist() == loop_extend(lengths, prompts, K)
    starts, _ = pool_table(torch.tensor(_cu(lengths)), K)
    assert got.shape == starts.shape
    # also through ShardedSequence (validated tuple) for other pool sizes
    seq = ShardedSequence.split(_cu(lengths), world_size=3, rank=1, prompt_lens=prompts)
    assert seq.prompt_lens == tuple(prompts)
    assert seq.has_prompts == any(p >= 1 for p in prompts)
    for kp in (1, 2, 5):
        assert extend_pools(seq.real_cu_seq_lens, seq.prompt_lens, kp).tolist() == loop_extend(lengths, prompts, kp)


def test_extend_pools_boundaries_explicitly():
    cu = torch.tensor([0, 14])
    assert extend_pools(cu, [7], K).tolist() == [True, False, False]  # pool 1 ends at token 7: not in a prompt of 7
    assert extend_pools(cu, [8], K).tolist() == [True, True, False]
    assert extend_pools(cu, [11], K).tolist() == [True, True, False]
    assert extend_pools(cu, [12], K).tolist() == [True, True, True]
    assert extend_pools(cu, [3], K).tolist() == [False, False, False]
    assert extend_pools(cu, [4], K).tolist() == [True, False, False]


# ============================================== tests: the schedule changes selections


@pytest.mark.parametrize("precision", ["bf16-serving", "fp8"])
def test_schedule_changes_pools_and_ids_as_the_reference_says(precision):
    x, prompts, meta = crafted_problem(precision)
    opts = dict(topk=8, kpool=K, precision=precision)
    got = run1(x, prompts, **opts)
    none = run1(x, None, **opts)
    want_sched = reference_sets(x, prompts, precision, 8, meta)
    want_none = reference_sets(x, None, precision, 8, meta)
    # the construction works: the schedule changes the reference's rows 11..13 of document 0
    assert [t for t in range(len(want_sched)) if want_sched[t] != want_none[t]] == [11, 12, 13]
    assert sets_of(got) == want_sched
    assert sets_of(none) == want_none
    # all zero = no schedule, bitwise
    assert torch.equal(run1(x, (0,) * 5, **opts), none)
    # the pools themselves (the library's, with the rule's mask) are the reference's
    starts, _ = pool_table(torch.tensor(x.cu_seq_lens), K)
    mask = extend_pools(torch.tensor(x.cu_seq_lens), prompts, K)
    want = np_serving(x.k.numpy(), x.gates.numpy(), x.ape.numpy(), starts.numpy(), mask.numpy())
    bf = serving.prepare_pools_bf16_serving(x.k, x.gates, x.ape, starts, mask)
    assert np.array_equal(bf.float().numpy().view(np.int32), np_bf16(want).view(np.int32))
    assert not torch.equal(bf, serving.prepare_pools_bf16_serving(x.k, x.gates, x.ape, starts))


@pytest.mark.parametrize("precision", ["bf16-serving", "fp8"])
def test_schedule_boundary_through_kpool_topk(precision):
    # document 0: pools B (0), A (1, crafted), X (2); A's order decides rows 11..13
    x, prompts, meta = crafted_problem(precision)
    opts = dict(topk=8, kpool=K, precision=precision, tail="compact", order="score")
    rest = prompts[1:]
    none = run1(x, None, **opts)
    sched = run1(x, (8,) + rest, **opts)
    assert not torch.equal(sched, none)
    assert torch.equal(run1(x, (7,) + rest, **opts)[:14], none[:14])  # A ends at token 8: decode for 7
    assert torch.equal(run1(x, (1,) + rest, **opts)[:14], none[:14])
    for p in (9, 11, 12, 13, 14):  # mid-pool, aligned, full: A extend
        assert torch.equal(run1(x, (p,) + rest, **opts)[:14], sched[:14]), p


def test_bf16_precision_ignores_the_schedule():
    for precision in ("bf16-serving", "fp8"):  # inputs where the serving modes do depend on it
        x, prompts, _ = crafted_problem(precision)
        for tail in ("fixed", "compact"):
            opts = dict(topk=8, kpool=K, precision="bf16", tail=tail)
            ref = run1(x, None, **opts)
            assert torch.equal(run1(x, prompts, **opts), ref)
            assert torch.equal(run1(x, [n for n in np.diff(x.cu_seq_lens).tolist()], **opts), ref)


# ============================================================ tests: bad prompt_lens


@pytest.mark.parametrize("prompts, exc, text", [
    ([3, 1], ValueError, "prompt_lens"),  # wrong count
    ([3, 1, 2, 0], ValueError, "prompt_lens"),
    ([3, -1, 2], ValueError, "prompt_lens[1]"),
    ([3, 1, 6], ValueError, "prompt_lens[2]"),  # > len
    ([15, 1, 2], ValueError, "prompt_lens[0]"),
    ([3.0, 1, 2], TypeError, "prompt_lens[0]"),
    ([3, True, 2], TypeError, "prompt_lens[1]"),
    (5, TypeError, "prompt_lens"),
    (torch.tensor([3.0, 1.0, 2.0]), TypeError, "prompt_lens"),
])  # fmt: skip
def test_bad_prompt_lens_name_the_argument(prompts, exc, text):
    cu = [0, 14, 15, 20]
    with pytest.raises(exc) as info:
        ShardedSequence.split(cu, world_size=1, rank=0, prompt_lens=prompts)
    assert text in str(info.value)
    with pytest.raises(exc) as info:
        ShardedSequence.from_group(cu, prompt_lens=prompts)
    assert text in str(info.value)


def test_good_prompt_lens_forms():
    cu = [0, 14, 15, 20]
    for p in ([3, 1, 5], (3, 1, 5), torch.tensor([3, 1, 5])):
        assert ShardedSequence.split(cu, world_size=2, rank=0, prompt_lens=p).prompt_lens == (3, 1, 5)
    assert ShardedSequence.split(cu, world_size=2, rank=0).prompt_lens is None
    assert not ShardedSequence.split(cu, world_size=2, rank=0, prompt_lens=[0, 0, 0]).has_prompts
    # the padding document of world size 3 (20 -> 21 tokens) takes no prompt length
    seq = ShardedSequence.split(cu, world_size=3, rank=2, prompt_lens=[14, 1, 5])
    assert seq.num_padding == 1 and seq.prompt_lens == (14, 1, 5)


# ================================================================= tests: gloo ranks

COMBOS = [(p, g, b) for p in ("fp8", "bf16-serving") for g in ("keys", "pools") for b in ("none", "causal")]


def _schedule_ranks(rank, world_size):
    """Every option combination with the crafted schedule-dependent problem: this rank's rows
    against world size 1 (same prompt_lens; also with a small logits budget: several
    chunks), and whether the schedule mattered at world size 1."""
    out = []
    for precision in ("fp8", "bf16-serving"):
        x, prompts, _ = crafted_problem(precision)
        seq = ShardedSequence.split(x.cu_seq_lens, world_size=world_size, rank=rank, prompt_lens=prompts)
        lo, hi = seq.shard_start, min(seq.shard_end, seq.num_real_tokens)
        n = max(0, hi - lo)
        for budget in (None, 600):
            opts = dict(topk=8, kpool=K, precision=precision, tail="compact", order="score")
            if budget:
                opts["max_logits_bytes"] = budget
            ref = run1(x, prompts, **opts)
            matters = not torch.equal(ref, run1(x, None, **opts))
            for gather in ("keys", "pools"):
                for balance in ("none", "causal"):
                    got = kpool_topk(**shard_inputs(x, seq), seq=seq, gather=gather, balance=balance, **opts)
                    equal = torch.equal(got[:n], ref[lo:hi]) and bool((got[n:] == -1).all())
                    out.append((precision, gather, balance, budget, equal, matters))
    return out


@pytest.mark.xdist_group("ranks")
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gloo_ranks_with_a_schedule_equal_world_size_one(world_size):
    results = run_ranks(_schedule_ranks, world_size, timeout=240)
    for rank, reports in enumerate(results):
        assert len(reports) == 2 * len(COMBOS)
        for rep in reports:
            assert rep[4], (rank, rep)
            assert rep[5], (rank, rep)


# ============================================================ tests: Triton kernels

CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schedule_interp_cases.py")


def test_serving_kernels_with_a_schedule_in_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-W", "ignore::pytest.PytestUnknownMarkWarning", "--rootdir", str(tmp_path), CASES]
    res = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    tail = (res.stdout + res.stderr)[-6000:]
    assert res.returncode == 0, tail
    assert " passed" in res.stdout and " failed" not in res.stdout and "skipped" not in res.stdout, tail
