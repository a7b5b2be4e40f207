"""The fused FP8 kernel (:mod:`sp_kpool.kernels.triton_fp8_fused`) on a GPU: its dense mode's
logits bit for bit DeepGEMM's ``fp8_mqa_logits`` (``torch.equal`` on the int32 view of every
in-range cell) at H 32, 64 and 128 on random inputs, heavy ties, ReLU plateaus, NaN and
infinities, rows not multiples of the tiles; every compiled variant uses ``wgmma`` and no
``mma.sync``; the fused selection equal to the pipeline's dense path (DeepGEMM + the Triton
selector) bit for bit on whole calls, and repeated calls bitwise equal. At H 128 (which
DeepGEMM's SM90 API refuses, so the deepgemm backend scores with this kernel's dense mode):
the logits equal DeepGEMM's H 32 and H 64 logits of the first heads bit for bit when the
other heads' weights are zero (their chain steps then add exact zeros), and the backend's
ids equal the torch fp8 backend's up to near-ties."""

import dataclasses

import pytest
import torch

from sp_kpool.pipeline import RunRecord, solve
from sp_kpool.settings import Settings
from sp_kpool.testing.gpu_checks import scorer_inputs, scorer_ranges, visible
from sp_kpool.testing.problems import rank_slice_problem

pytestmark = [pytest.mark.requires("deep_gemm", "triton"), pytest.mark.xdist_group("gpu")]


@pytest.mark.parametrize("case", ["random", "ties", "plateau", "nonfinite"])
@pytest.mark.parametrize("H,bq,one_dot", [(32, 4, True), (32, 4, False), (64, 2, True), (64, 4, False), (64, 4, True)])
def test_dense_logits_are_deepgemms_bit_for_bit(H, bq, one_dot, case):
    # (DeepGEMM 2.5 refuses H 128: "num_heads == 16 or num_heads == 32 or num_heads == 64")
    import deep_gemm

    from sp_kpool.kernels import triton_fp8_fused as ff

    S, P = 1021, 3001
    q8, w, k8, scale = scorer_inputs(S, H, P, seed=H + bq, case=case)
    starts, ends = scorer_ranges(S, P, seed=H)
    ref = deep_gemm.fp8_mqa_logits(q8, (k8, scale), w, starts, ends, clean_logits=False)
    got = ff.score_select(q8, w, k8, scale, starts, ends, 512, dense=True, block_q=bq, one_dot=one_dot)
    vis = visible(starts, ends, P)
    a, b = got[vis].view(torch.int32), ref[:, :P][vis].view(torch.int32)
    bad = int((a != b).sum())
    assert bad == 0, f"{bad} of {a.numel()} logits differ; first: {got[vis][a != b][:4]} vs {ref[:, :P][vis][a != b][:4]}"
    ptx = ff.compiled[(H, bq, ff.BLOCK_P, True, one_dot, torch.float8_e4m3fn)].asm["ptx"]
    assert "wgmma.mma_async.sync.aligned" in ptx and "e4m3.e4m3" in ptx and "mma.sync" not in ptx.replace(
        "wgmma.mma_async.sync", "")  # fmt: skip


@pytest.mark.parametrize("case", ["random", "ties", "nonfinite"])
@pytest.mark.parametrize("H,bq", [(32, 4), (64, 2)])
def test_dense_pairs_logits_are_deepgemms_bit_for_bit(H, bq, case):
    # two row blocks per program (pairs=True): the same bits as DeepGEMM, wgmma and no mma.sync
    import deep_gemm

    from sp_kpool.kernels import triton_fp8_fused as ff

    S, P = 1021, 3001
    q8, w, k8, scale = scorer_inputs(S, H, P, seed=H + bq + 1, case=case)
    starts, ends = scorer_ranges(S, P, seed=H + 1)
    ref = deep_gemm.fp8_mqa_logits(q8, (k8, scale), w, starts, ends, clean_logits=False)
    got = ff.score_select(q8, w, k8, scale, starts, ends, 512, dense=True, block_q=bq, pairs=True)
    vis = visible(starts, ends, P)
    a, b = got[vis].view(torch.int32), ref[:, :P][vis].view(torch.int32)
    assert int((a != b).sum()) == 0, f"{int((a != b).sum())} of {a.numel()} logits differ"
    ptx = ff.compiled[(H, bq, ff.BLOCK_P, True, True, torch.float8_e4m3fn, "pairs")].asm["ptx"]
    assert "wgmma.mma_async.sync.aligned" in ptx and "mma.sync" not in ptx.replace("wgmma.mma_async.sync", "")


@pytest.mark.parametrize("k", [512, 2048, 7])
@pytest.mark.parametrize("H", [32, 64, 128])
def test_fused_selection_equals_dense_plus_exact_selector(H, k):
    from sp_kpool.kernels import triton_fp8_fused as ff
    from sp_kpool.selectors import topk_pools, _ascending

    S, P = 777, 5003
    q8, w, k8, scale = scorer_inputs(S, H, P, seed=k, case="random")
    starts, ends = scorer_ranges(S, P, seed=k)
    dense = ff.score_select(q8, w, k8, scale, starts, ends, k, dense=True)
    vis = visible(starts, ends, P) & (dense > -float("inf"))
    pools, ok = topk_pools(torch.where(vis, dense, 0.0), vis, k, 0)
    want = torch.full((S, k), -1, dtype=torch.int32, device="cuda")
    want[:, : pools.shape[1]] = _ascending(torch.where(ok, pools, -1)).int()
    got, emitted = ff.score_select(q8, w, k8, scale, starts, ends, k)
    assert torch.equal(got, want)
    for slots in ("scan", "atomic"):  # both ways of taking buffer slots: the same ids and counts
        got2, emitted2 = ff.score_select(q8, w, k8, scale, starts, ends, k, slots=slots)
        assert torch.equal(got2, want) and torch.equal(emitted2, emitted), slots
    ptx = ff.compiled[(H, max(2, 128 // H), ff.BLOCK_P, False, True, torch.float8_e4m3fn)].asm["ptx"]  # the default launch
    assert "wgmma.mma_async.sync.aligned" in ptx


@pytest.mark.parametrize("bq,one_dot", [(4, False), (1, True), (2, True)])
@pytest.mark.parametrize("case", ["random", "ties", "plateau"])
@pytest.mark.parametrize("first", [32, 64])
def test_h128_logits_extend_deepgemms_chains(first, case, bq, one_dot):
    # heads >= first with weight 0: each of their chain steps is fma(r, 0, c) = c (r finite),
    # so the H 128 logit is DeepGEMM's logit of heads [0, first), bit for bit (-0 read as +0)
    import deep_gemm

    from sp_kpool.kernels import triton_fp8_fused as ff

    S, P = 1021, 3001
    q8, w, k8, scale = scorer_inputs(S, 128, P, seed=first, case=case)
    w[:, first:] = 0.0
    starts, ends = scorer_ranges(S, P, seed=first + 1)
    ref = deep_gemm.fp8_mqa_logits(q8[:, :first].contiguous(), (k8, scale), w[:, :first].contiguous(), starts, ends,
                                   clean_logits=False)[:, :P]  # fmt: skip
    got = ff.score_select(q8, w, k8, scale, starts, ends, 512, dense=True, block_q=bq, one_dot=one_dot)
    vis = visible(starts, ends, P)
    a, b = (got[vis] + 0.0).view(torch.int32), (ref[vis] + 0.0).view(torch.int32)
    bad = int((a != b).sum())
    assert bad == 0, f"{bad} of {a.numel()} logits differ; first: {got[vis][a != b][:4]} vs {ref[vis][a != b][:4]}"
    assert int((got[vis] != 0).sum()) > a.numel() // 4  # not a plateau of zeros everywhere
    ptx = ff.compiled[(128, bq, ff.BLOCK_P, True, one_dot, torch.float8_e4m3fn)].asm["ptx"]
    assert "wgmma.mma_async.sync.aligned" in ptx and "mma.sync" not in ptx.replace("wgmma.mma_async.sync", "")


@pytest.mark.parametrize("total,lengths", [(8195, [4000, 3, 4192]), (16384, None)])
def test_h128_deepgemm_backend_vs_torch_fp8(total, lengths):
    from sp_kpool import serving
    from sp_kpool.backends import BACKENDS
    from sp_kpool.pooling import pool_table
    from sp_kpool.testing.gpu_checks import fp8_row_scores, ids_of, near_tie_rows

    p = rank_slice_problem(total, 4, 3, heads=128, head_dim=128, topk=2048, lengths=lengths, precision="fp8", seed=5)
    x = ids_of("deepgemm", p)
    y = ids_of("torch", p)
    st = pool_table(p.seq.real_cu_seq_lens, 4)[0].cuda()
    k8, ks = BACKENDS["torch"].pools(p, st).parts()
    q8, wq = serving.prepare_queries_fp8(p.q, p.head_weights)
    ndiff, bad = near_tie_rows(p, x, y, fp8_row_scores(q8, wq, k8, ks), rel_tol=1e-3)
    assert not bad, f"rows={x.shape[0]} differing_rows={ndiff} beyond_near_tie={bad[:5]}"
    for _ in range(3):
        assert torch.equal(ids_of("deepgemm", p), x)


CALLS = [dict(total=16384, lengths=None), dict(total=8195, lengths=[4000, 3, 4192]),
         dict(total=131072, lengths=[2048] * 64)]  # fmt: skip


@pytest.mark.parametrize("topk", [2048, 8192])
@pytest.mark.parametrize("case", CALLS, ids=["one-doc", "packed", "64x2048"])
@pytest.mark.parametrize("H", [32, 64, 128])  # H 128: the dense path scores with this kernel's dense mode
def test_whole_call_fused_equals_dense_path(H, case, topk):
    p = rank_slice_problem(case["total"], 4, 3, heads=H, head_dim=128, precision="fp8", lengths=case["lengths"],
                           topk=topk, device="cuda")  # fmt: skip
    want = solve(dataclasses.replace(p, settings=Settings(fused=False)), "deepgemm").ids
    pf, record = dataclasses.replace(p, settings=Settings(fused=True)), RunRecord()
    got = solve(pf, "deepgemm", record).ids
    assert record.counters.get("selector") == "triton-fused", record.counters
    assert torch.equal(got, want)
    for _ in range(3):
        assert torch.equal(solve(pf, "deepgemm").ids, got)
