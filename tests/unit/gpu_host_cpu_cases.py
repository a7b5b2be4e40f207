"""The GPU backends' host code on CPU: ``deepgemm``, ``tilelang`` and ``triton`` with the
kernels they launch replaced by :mod:`sp_kpool.testing.standins` (DeepGEMM, TileLang, the
CUDA scorer of ``SP_KPOOL_CUDA_SCORER=1``) or run by Triton's CPU interpreter (pools,
queries, ranges, scorer, selector, expansion), against the torch backend, bit for bit.

Not collected directly (the name does not start with ``test_``):
``test_gpu_host_cpu.py`` runs this file in a child pytest with ``TRITON_INTERPRET=1``.
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run this file with TRITON_INTERPRET=1 (tests/unit/test_gpu_host_cpu.py does)")

import sp_kpool  # noqa: E402
from sp_kpool.backends.deepgemm_logits import logits_bytes  # noqa: E402
from sp_kpool.sharding import ShardedSequence  # noqa: E402
from sp_kpool.testing import standins  # noqa: E402
from sp_kpool.testing.problems import GlobalInputs, make_inputs, simulate_ranks  # noqa: E402

#: small packed documents, odd lengths, one of a single token (K = 4: 9 pools; first pools
#: 0, 4, 4, 7: chunk pool ranges start off multiples of 4)
LENGTHS = [19, 1, 12, 9]
SMALL = [6, 9]
K, TOPK = 4, 8  # 2 pools per row: the selection matters


def exact_inputs(lengths, heads, dim, seed=0):
    """BF16 inputs whose BF16-mode scores are exact in FP32 (small integer keys and
    queries, dyadic weights, gates that make each pool's slot softmax one-hot per channel):
    every correct implementation agrees bit for bit, ties included (D^-0.5 H^-0.5 dyadic
    for D 64, H 16)."""
    g = torch.Generator().manual_seed(seed)
    S = sum(lengths)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    pos = torch.arange(S)
    doc = torch.searchsorted(torch.tensor(cu), pos, right=True) - 1
    slot = (pos - torch.tensor(cu)[doc]) % K
    hot = slot[:, None] == (torch.arange(dim) % K)[None]
    return GlobalInputs(
        cu_seq_lens=cu,
        q=torch.randint(-3, 4, (S, heads, dim), generator=g).bfloat16(),
        k=torch.randint(-3, 4, (S, dim), generator=g).bfloat16(),
        gates=torch.where(hot, 60.0, -60.0).bfloat16(),
        head_weights=(torch.randint(-2, 3, (S, heads), generator=g).float() * 0.5).bfloat16(),
        ape=torch.zeros(K, dim, dtype=torch.bfloat16),
    )


def both(monkeypatch, x, world, backend, precision, budget, install=None, **opts):
    """(torch backend's output, ``backend``'s with the stand-ins) of every rank, concatenated."""
    ref = torch.cat(simulate_ranks(x, world, topk=TOPK, kpool=K, backend="torch", precision=precision, **opts))
    settings = standins.install(monkeypatch, **(install or {})).settings
    got = torch.cat(simulate_ranks(x, world, topk=TOPK, kpool=K, backend=backend, precision=precision,
                                   max_logits_bytes=budget, settings=settings, **opts))  # fmt: skip
    return ref, got


def legacy_row_bytes(heads, pools=17, a=64):
    return logits_bytes(1, pools, heads, "legacy", a) // max(1, 128 // heads)


# (layout / api, H, world, tail, order, triton selector): budgets of 8 rows (H 32: 2 row
# groups, H 64: 4) for 41 rows: chunks of 8, a partial last one, chunk pool ranges
# starting off multiples of 4 (the kv shift)
DG_CASES = [
    (dict(layout="legacy"), 32, 1, "fixed", "ascending", True),
    (dict(layout="compact"), 64, 3, "compact", "score", True),
    (dict(layout=None, api="fp8_fp4"), 32, 3, "fixed", "score", False),  # compact by detection, clean paths
    (dict(layout="legacy"), 64, 3, "compact", "ascending", False),  # legacy with clean_logits
]


@pytest.mark.parametrize("install,heads,world,tail,order,selector", DG_CASES)
def test_deepgemm_equals_torch_fp8(monkeypatch, install, heads, world, tail, order, selector):
    x = make_inputs(LENGTHS, heads=heads, head_dim=128, kpool=K, seed=heads + world, dtype=torch.bfloat16)
    layout = install.get("layout") or "compact"
    stride = 256 if layout == "compact" else 320  # 9 (+ shift) pools
    budget = 8 * stride * 4
    ref, got = both(monkeypatch, x, world, "deepgemm", "fp8", budget, dict(install, triton_selector=selector),
                    tail=tail, order=order)  # fmt: skip
    assert torch.equal(got, ref)
    assert int((ref >= 0).sum()) > 0


def test_deepgemm_budget_below_one_row_group(monkeypatch):
    x = make_inputs(SMALL, heads=32, head_dim=128, kpool=K, seed=1, dtype=torch.bfloat16)
    settings = standins.install(monkeypatch, layout="legacy").settings
    one_group = 4 * 320 * 4  # 128 / H = 4 rows of stride align(3 + 256, 64)
    kw = dict(topk=TOPK, kpool=K, backend="deepgemm", precision="fp8", settings=settings)
    with pytest.raises(ValueError, match=f"max_logits_bytes: expected at least {one_group}"):
        simulate_ranks(x, 1, max_logits_bytes=one_group - 1, **kw)
    simulate_ranks(x, 1, max_logits_bytes=one_group, **kw)


@pytest.mark.parametrize("layout", ["legacy", "compact"])
def test_deepgemm_storage_check_fires(monkeypatch, layout):
    # a kernel that allocates one padded row group more than predicted
    x = make_inputs(SMALL, heads=32, head_dim=128, kpool=K, seed=2, dtype=torch.bfloat16)
    settings = standins.install(monkeypatch, layout=layout, extra_rows=4).settings
    with pytest.raises(RuntimeError, match="deepgemm: logits storage .* exceeds the budget"):
        simulate_ranks(x, 1, topk=TOPK, kpool=K, backend="deepgemm", precision="fp8", max_logits_bytes=1 << 20,
                       settings=settings)  # fmt: skip


def test_deepgemm_gather_pools(monkeypatch):
    x = make_inputs(SMALL, heads=32, head_dim=128, kpool=K, seed=5, dtype=torch.bfloat16)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    args = (x.q, x.k, x.gates, x.head_weights, x.ape, seq)
    ref = sp_kpool.kpool_topk(*args, topk=TOPK, kpool=K, backend="torch", precision="fp8")
    settings = standins.install(monkeypatch, layout="compact").settings
    got = sp_kpool.kpool_topk(*args, topk=TOPK, kpool=K, backend="deepgemm", precision="fp8", gather="pools",
                              max_logits_bytes=4 * 256 * 4, order="score", settings=settings)  # fmt: skip
    assert torch.equal(got.sort(-1).values, ref.sort(-1).values)  # same sets (ref: ascending, got: score order)



# H 128: DeepGEMM's host API refuses it; the backend scores with the Triton kernel of the same
# arithmetic (run here by the interpreter: its dot is not the GPU's tensor-core sum, so these
# cases check the host code around it: chunks, column offsets, masking, selection; the bits
# are the GPU tests' business). 2 of at most 9 pools per row: no near-ties on these inputs.
@pytest.mark.parametrize("world,tail,order,selector", [(1, "fixed", "ascending", True), (3, "compact", "score", False)])
def test_deepgemm_h128_scores_with_the_triton_kernel(monkeypatch, world, tail, order, selector):
    from sp_kpool.backends import deepgemm_backend as dgb

    x = make_inputs(LENGTHS, heads=128, head_dim=128, kpool=K, seed=11 + world, dtype=torch.bfloat16)
    called = []
    real = dgb.score_triton
    monkeypatch.setattr(dgb, "score_triton", lambda *a: called.append(1) or real(*a))
    budget = 5 * 9 * 4  # 5-row chunks of at most 9 pools
    ref, got = both(monkeypatch, x, world, "deepgemm", "fp8", budget, dict(triton_selector=selector),
                    tail=tail, order=order)  # fmt: skip
    assert called and torch.equal(got, ref)
    assert int((ref >= 0).sum()) > 0


def test_deepgemm_h128_needs_no_deep_gemm(monkeypatch):
    # without deep_gemm the backend still takes H 128 (the Triton scorer) and refuses H 32
    from sp_kpool.backends import BACKENDS
    from sp_kpool.backends import deepgemm_backend as dgb
    from sp_kpool.testing.problems import rank_slice_problem

    standins.install(monkeypatch)
    real = dgb.probe
    monkeypatch.setattr(dgb, "probe", lambda m: (None, "no deep_gemm here") if m == "deep_gemm" else real(m))
    be = BACKENDS["deepgemm"]
    for H, want in ((128, []), (32, ["no deep_gemm here"])):
        p = rank_slice_problem(64, 1, 0, heads=H, head_dim=128, topk=8, kpool=K, precision="fp8", device="cpu")
        assert be.not_supported_reasons(p) == want, H



def test_short_row_hint_reaches_the_selector(monkeypatch):
    # the pipeline tells the Triton selector which chunks hold no short row (k = 2 pools: rows
    # past the 11th token of a document are long); the ids do not depend on it
    from sp_kpool.kernels import triton_topk

    seen = []
    real = triton_topk.topk_ascending
    monkeypatch.setattr(triton_topk, "topk_ascending",
                        lambda *a, short_rows=True, **kw: seen.append(short_rows) or real(*a, short_rows=short_rows, **kw))  # fmt: skip
    x = make_inputs([40, 3, 30], heads=32, head_dim=128, kpool=K, seed=4, dtype=torch.bfloat16)
    ref, got = both(monkeypatch, x, 1, "deepgemm", "fp8", 8 * 256 * 4, dict(layout="compact"))
    assert torch.equal(got, ref)
    assert True in seen and False in seen, seen
    # documents of at most (k + 1) kpool - 1 tokens: every row is short, the selector is told so
    seen.clear()
    x = make_inputs([11, 3, 8, 11], heads=32, head_dim=128, kpool=K, seed=5, dtype=torch.bfloat16)
    ref, got = both(monkeypatch, x, 1, "deepgemm", "fp8", 8 * 256 * 4, dict(layout="compact"))
    assert torch.equal(got, ref)
    assert seen and set(seen) == {"all"}, seen


TL_CASES = [
    ("bf16", 16, 64, 1, "fixed", "ascending", True, True),
    ("bf16-serving", 16, 64, 3, "compact", "score", True, True),
    ("bf16", 32, 128, 3, "fixed", "score", False, False),  # random inputs; clean scores
]


@pytest.mark.parametrize("precision,heads,dim,world,tail,order,selector,exact", TL_CASES)
def test_tilelang_equals_torch(monkeypatch, precision, heads, dim, world, tail, order, selector, exact):
    if exact:
        x = exact_inputs(LENGTHS, heads, dim, seed=heads + world)
    else:
        x = make_inputs(LENGTHS, heads=heads, head_dim=dim, kpool=K, seed=heads, dtype=torch.bfloat16)
    budget = 7 * 9 * 4  # 7-row chunks
    ref, got = both(monkeypatch, x, world, "tilelang", precision, budget, dict(triton_selector=selector),
                    tail=tail, order=order)  # fmt: skip
    assert torch.equal(got, ref)


def test_tilelang_host_function_matches_contract(monkeypatch):
    # the real tilelang_scores (row padding to 128 / H, row groups' column ranges) around the
    # kernel stand-in equals the contract stand-in, bit for bit (exact inputs)
    from sp_kpool.kernels import tilelang_score

    standins.install(monkeypatch)
    g = torch.Generator().manual_seed(0)
    R, H, D, N = 13, 32, 64, 40  # 13 rows: padded to 16
    q = torch.randint(-3, 4, (R, H, D), generator=g).bfloat16()
    keys = torch.randint(-3, 4, (N, D), generator=g).bfloat16()
    w = torch.randint(-2, 3, (R, H), generator=g).float() * 0.25
    starts = torch.randint(0, N, (R,), generator=g).int()
    ends = torch.minimum(starts + torch.randint(0, 20, (R,), generator=g).int(), torch.tensor(N)).int()
    ends[3] = starts[3]  # an empty row
    for clean in (True, False):
        got = tilelang_score.tilelang_scores(q, w, keys, starts, ends, clean=clean)
        want = standins.tilelang_scores(q, w, keys, starts, ends, clean=clean)
        inside = (torch.arange(N)[None] >= starts[:, None]) & (torch.arange(N)[None] < ends[:, None])
        assert got.shape == (R, N)
        assert torch.equal(got[inside], want[inside])
        if clean:
            assert torch.equal(got, want)


# the triton backend (BF16 modes): its scorer run by the interpreter (the dot's sum is NumPy's,
# not the tensor core's: exact inputs make every order give the same bits; random ones pick
# 2 of at most 9 pools, no near-ties), its pools by the interpreted pooling kernels
TR_CASES = [
    ("bf16", 32, 1, "fixed", "ascending", True, True),
    ("bf16-serving", 32, 3, "compact", "score", True, True),
    ("bf16", 64, 3, "fixed", "score", False, False),
    ("bf16-serving", 128, 2, "fixed", "ascending", True, False),
]


@pytest.mark.parametrize("precision,heads,world,tail,order,selector,exact", TR_CASES)
def test_triton_backend_equals_torch(monkeypatch, precision, heads, world, tail, order, selector, exact):
    from sp_kpool.backends import triton_backend as trb

    if exact:
        x = exact_inputs(LENGTHS, heads, 128, seed=heads + world)
    else:
        x = make_inputs(LENGTHS, heads=heads, head_dim=128, kpool=K, seed=heads + world, dtype=torch.bfloat16)
    called = []
    real = trb.score_triton
    monkeypatch.setattr(trb, "score_triton", lambda *a: called.append(a[3].dtype) or real(*a))
    budget = 7 * 9 * 4  # 7-row chunks
    ref, got = both(monkeypatch, x, world, "triton", precision, budget, dict(triton_selector=selector),
                    tail=tail, order=order)  # fmt: skip
    assert called and set(called) == {torch.bfloat16}
    assert torch.equal(got, ref)
    assert int((ref >= 0).sum()) > 0


def test_auto_prefers_triton_for_bf16_where_it_runs(monkeypatch):
    # auto: triton before tilelang for H 32/64/128 at D 128; tilelang for the other shapes
    from sp_kpool.backends import BACKENDS, resolve_backend
    from sp_kpool.testing.problems import rank_slice_problem

    standins.install(monkeypatch)
    for H, D, want in ((32, 128, "triton"), (128, 128, "triton"), (16, 128, "tilelang"), (32, 64, "tilelang")):
        p = rank_slice_problem(64, 1, 0, heads=H, head_dim=D, topk=8, kpool=K, precision="bf16", device="cpu")
        assert resolve_backend("auto", p).name == want, (H, D)
    p = rank_slice_problem(64, 1, 0, heads=16, head_dim=128, topk=8, kpool=K, precision="bf16", device="cpu")
    assert BACKENDS["triton"].not_supported_reasons(p) == ["H = 16 not in [32, 64, 128]"]


@pytest.mark.parametrize("precision,world", [("bf16", 1), ("bf16-serving", 3)])
def test_triton_backend_fused_equals_torch(monkeypatch, precision, world):
    # SP_KPOOL_FUSED=1: the triton backend's chunks scored and selected in one kernel (the
    # interpreter runs the fused mode on BF16 inputs), the same ids as the torch backend
    import dataclasses

    from sp_kpool import scoring

    x = exact_inputs(LENGTHS, 32, 128, seed=7 + world)
    ref = torch.cat(simulate_ranks(x, world, topk=TOPK, kpool=K, backend="torch", precision=precision))
    settings = dataclasses.replace(standins.install(monkeypatch).settings, fused=True)
    chosen = []
    real = scoring.choose_fused
    monkeypatch.setattr(scoring, "choose_fused", lambda b, p: chosen.append(real(b, p)) or chosen[-1])
    got = torch.cat(simulate_ranks(x, world, topk=TOPK, kpool=K, backend="triton", precision=precision,
                                   max_logits_bytes=7 * 9 * 4, settings=settings))  # fmt: skip
    assert chosen and all(c is not None and c.name == "triton-fused" for c in chosen)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("what", ["q", "head_weights"])
def test_triton_backend_takes_any_strides(monkeypatch, what):
    # the rank's queries with non-adjacent channels, or transposed head weights (the same
    # values): the scorer gets operands laid out as it reads them, the ids equal the torch
    # backend's (one chunk for all rows: scored from views of the rows as given)
    from sp_kpool.config import KPoolConfig, RunOptions
    from sp_kpool.pipeline import run_gathered
    from sp_kpool.testing.problems import layout_seqs, shard_inputs

    x = make_inputs(LENGTHS, heads=32, head_dim=128, kpool=K, seed=21, dtype=torch.bfloat16)
    seq = layout_seqs(x.cu_seq_lens, 1)[0]
    d = shard_inputs(x, seq)
    ref = run_gathered(d, seq, KPoolConfig(topk=TOPK, kpool=K, precision="bf16"), RunOptions(backend="torch")).ids
    t = d[what]
    d[what] = t.transpose(1, 2).contiguous().transpose(1, 2) if what == "q" else t.t().contiguous().t()
    assert d[what].stride(-1) != 1
    settings = standins.install(monkeypatch).settings
    config = KPoolConfig(topk=TOPK, kpool=K, precision="bf16", max_logits_bytes=64 * 7 * 9 * 4)
    got = run_gathered(d, seq, config, RunOptions(backend="triton"), settings).ids
    assert torch.equal(got, ref)


@pytest.mark.parametrize("layout", ["zigzag", "zigzag-per-document", "positions"])
@pytest.mark.parametrize("backend,precision", [("deepgemm", "fp8"), ("triton", "bf16")])
def test_row_local_backends_in_interleaved_layouts(monkeypatch, backend, precision, layout):
    # spans with rows of other ranks between their runs, in chunks of their own
    # (plan.local_chunks) smaller than the span: the torch backend's ids on every rank
    from sp_kpool.testing.problems import layout_seqs, random_rank_positions

    x = exact_inputs(LENGTHS, 32, 128, seed=len(layout))
    total = sum(LENGTHS)
    if layout == "positions":
        seqs = layout_seqs(x.cu_seq_lens, 2, rank_positions=random_rank_positions(total, 2, seed=3))
    else:
        seqs = layout_seqs(x.cu_seq_lens, 2, layout)
    budget = legacy_row_bytes(32) * 6 if backend == "deepgemm" else 7 * 9 * 4  # chunks of a few rows
    ref, got = both(monkeypatch, x, 2, backend, precision, budget, dict(layout="legacy") if backend == "deepgemm"
                    else None, seqs=seqs)  # fmt: skip
    assert torch.equal(got, ref)
    assert int((ref >= 0).sum()) > 0


# SP_KPOOL_CUDA_SCORER=1: the deepgemm (FP8) and triton (BF16) backends score with the CUDA
# scorer (its stand-in: the same arithmetic in each row's range, garbage elsewhere); the host
# code around it (chunks from the FP32 budget, aligned scales, the pipeline's masking where
# the reader needs -inf) gives the torch backend's ids. The bits of the real kernel are the GPU
# tests' business (tests/gpu/test_cuda_fp8_mqa.py).
CS_CASES = [
    ("deepgemm", "fp8", 32, 1, "fixed", "ascending", True),
    ("deepgemm", "fp8", 64, 3, "compact", "score", False),  # the reader needs -inf outside the ranges: not masked
    ("deepgemm", "fp8", 128, 2, "fixed", "ascending", True),
    ("triton", "bf16", 32, 1, "fixed", "ascending", True),
    ("triton", "bf16-serving", 64, 3, "compact", "score", False),
]


@pytest.mark.parametrize("backend,precision,heads,world,tail,order,selector", CS_CASES)
def test_cuda_scorer_equals_torch(monkeypatch, backend, precision, heads, world, tail, order, selector):
    import dataclasses

    from sp_kpool.kernels import cuda_fp8_mqa

    if precision == "fp8":
        x = make_inputs(LENGTHS, heads=heads, head_dim=128, kpool=K, seed=heads + world, dtype=torch.bfloat16)
        # keys of magnitudes 2^-3 .. 2^3 per token: pools with different scales (a scale read
        # for the wrong pool changes the ids)
        g = torch.Generator().manual_seed(world)
        mag = 2.0 ** torch.randint(-3, 4, (x.k.shape[0], 1), generator=g)
        x = dataclasses.replace(x, k=(x.k.float() * mag).bfloat16())
    else:
        x = exact_inputs(LENGTHS, heads, 128, seed=heads + world)
    ref = torch.cat(simulate_ranks(x, world, topk=TOPK, kpool=K, backend="torch", precision=precision, tail=tail,
                                   order=order))  # fmt: skip
    installed = standins.install(monkeypatch, triton_selector=selector)
    settings = dataclasses.replace(installed.settings, cuda_scorer=True)
    called = []
    real = cuda_fp8_mqa.score
    monkeypatch.setattr(cuda_fp8_mqa, "score", lambda q, *a, **kw: called.append((q.dtype, kw["q_blocks"])) or
                        real(q, *a, **kw))  # fmt: skip
    got = torch.cat(simulate_ranks(x, world, topk=TOPK, kpool=K, backend=backend, precision=precision, tail=tail,
                                   order=order, max_logits_bytes=7 * 9 * 4, settings=settings))  # fmt: skip
    want_dtype = torch.float8_e4m3fn if precision == "fp8" else torch.bfloat16
    assert called and set(called) == {(want_dtype, 2)}, called
    assert torch.equal(got, ref)
    assert int((ref >= 0).sum()) > 0


def test_cuda_scorer_needs_no_deep_gemm_but_nvcc(monkeypatch):
    # with the CUDA scorer the deepgemm backend takes H 32 without deep_gemm; without nvcc
    # both backends say why they cannot take the call
    import dataclasses

    from sp_kpool.backends import BACKENDS
    from sp_kpool.backends import deepgemm_backend as dgb
    from sp_kpool.kernels import cuda_fp8_mqa
    from sp_kpool.testing.problems import rank_slice_problem

    settings = dataclasses.replace(standins.install(monkeypatch).settings, cuda_scorer=True)
    real = dgb.probe
    monkeypatch.setattr(dgb, "probe", lambda m: (None, "no deep_gemm here") if m == "deep_gemm" else real(m))
    for backend, precision in (("deepgemm", "fp8"), ("triton", "bf16")):
        p = rank_slice_problem(64, 1, 0, heads=32, head_dim=128, topk=8, kpool=K, precision=precision, device="cpu")
        p = dataclasses.replace(p, settings=settings)
        assert BACKENDS[backend].not_supported_reasons(p) == [], backend
    monkeypatch.setattr(cuda_fp8_mqa, "nvcc", lambda: None)
    for backend, precision in (("deepgemm", "fp8"), ("triton", "bf16")):
        p = rank_slice_problem(64, 1, 0, heads=32, head_dim=128, topk=8, kpool=K, precision=precision, device="cpu")
        p = dataclasses.replace(p, settings=settings)
        assert BACKENDS[backend].not_supported_reasons(p) == [
            "SP_KPOOL_CUDA_SCORER: no nvcc to build the CUDA scorer with (CUDA_HOME, PATH)"], backend
