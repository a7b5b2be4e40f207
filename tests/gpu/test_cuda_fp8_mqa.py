"""The CUDA scorer (:mod:`sp_kpool.kernels.cuda_fp8_mqa`) on a Hopper GPU.

- First, small: the smoke run of every variant with the debug build
  (:mod:`sp_kpool.testing.cuda_smoke`: a stuck pipeline wait traps after 1 s, naming its
  barrier; launches on the full grid and on two CTAs, so the stages wrap).
- Its dense mode's logits bit for bit DeepGEMM's ``fp8_mqa_logits`` (``torch.equal`` on the
  int32 view of every in-range cell) at H 32 and 64, with one and two query blocks per pool
  tile, on random inputs, heavy ties, ReLU plateaus, NaN and infinities, rows not multiples
  of the tiles, empty rows and starts that are not multiples of 4.
- At H 128 (which DeepGEMM's SM90 API refuses) bit for bit the Triton kernel's dense mode,
  itself checked against DeepGEMM's chains (``test_fused_fp8.py``); on BF16 inputs bit for
  bit the Triton kernel's BF16 dense mode (the ``triton`` backend's scorer) at H 32, 64, 128.
- Repeated calls bitwise equal; the no-store mode runs to the end; argument errors on CUDA
  tensors; whole calls with ``SP_KPOOL_CUDA_SCORER=1`` give the ids of the backends' default
  scorers.

Run the file under a time limit: a wrong pipeline wait in the release build would hang
(``scripts/gpu_evidence.sh cudatests`` runs each test function in its own process under
pytest-timeout, after ``cudasmoke`` ran each variant in its own process)."""

import pytest
import torch

from sp_kpool.testing import cuda_smoke
from sp_kpool.testing.gpu_checks import scorer_inputs, scorer_ranges, visible

pytestmark = [pytest.mark.requires("deep_gemm", "triton"), pytest.mark.xdist_group("gpu")]


@pytest.mark.parametrize("variant", cuda_smoke.VARIANTS)
def test_smoke_of_the_debug_build(variant):
    # first, small, with the KPOOL_DEBUG library (sp_kpool.testing.cuda_smoke, which
    # scripts/gpu_evidence.sh runs one variant per process): a pipeline wait that never
    # completes traps with its barrier printed (a failure with a place, not a hang); the run
    # ends; the dense logits equal the Triton kernel's (DeepGEMM's bits in FP8: test_fused_fp8)
    status, detail = cuda_smoke.run(variant)
    assert status == "pass", f"{status}: {detail}"


@pytest.mark.parametrize("case", ["random", "ties", "plateau", "nonfinite"])
@pytest.mark.parametrize("q_blocks", [1, 2])
@pytest.mark.parametrize("H", [32, 64])
def test_dense_logits_are_deepgemms_bit_for_bit(H, q_blocks, case):
    import deep_gemm

    from sp_kpool.kernels import cuda_fp8_mqa as cu

    S, P = 1021, 3001
    q8, w, k8, scale = scorer_inputs(S, H, P, seed=H + q_blocks, case=case)
    starts, ends = scorer_ranges(S, P, seed=H, odd=True)
    ref = deep_gemm.fp8_mqa_logits(q8, (k8, scale), w, starts, ends, clean_logits=False)
    got = cu.score(q8, w, k8, scale, starts, ends, q_blocks=q_blocks)
    vis = visible(starts, ends, P)
    a, b = got[vis].view(torch.int32), ref[:, :P][vis].view(torch.int32)
    bad = int((a != b).sum())
    assert bad == 0, f"{bad} of {a.numel()} logits differ; first: {got[vis][a != b][:4]} vs {ref[:, :P][vis][a != b][:4]}"


@pytest.mark.parametrize("q_blocks", [1, 2])
@pytest.mark.parametrize("case", ["random", "ties", "plateau"])
def test_h128_logits_are_the_triton_kernels(case, q_blocks):
    from sp_kpool.kernels import cuda_fp8_mqa as cu
    from sp_kpool.kernels import triton_fp8_fused as ff

    S, P = 1021, 3001
    q8, w, k8, scale = scorer_inputs(S, 128, P, seed=7 + q_blocks, case=case)
    starts, ends = scorer_ranges(S, P, seed=128, odd=True)
    ref = ff.score_select(q8, w, k8, scale, starts, ends, 512, dense=True)
    got = cu.score(q8, w, k8, scale, starts, ends, q_blocks=q_blocks)
    vis = visible(starts, ends, P)
    assert torch.equal(got[vis].view(torch.int32), ref[vis].view(torch.int32))


@pytest.mark.parametrize("q_blocks", [1, 2])
@pytest.mark.parametrize("case", ["random", "ties", "plateau"])
@pytest.mark.parametrize("H", [32, 64, 128])
def test_bf16_logits_are_the_triton_backends(H, case, q_blocks):
    # BF16 inputs, no scale: the `triton` backend's scorer (the Triton kernel's BF16 dense mode)
    from sp_kpool.kernels import cuda_fp8_mqa as cu
    from sp_kpool.kernels import triton_fp8_fused as ff

    S, P = 1021, 3001
    q, w, k, _ = scorer_inputs(S, H, P, seed=H + q_blocks, case=case, dtype=torch.bfloat16)
    starts, ends = scorer_ranges(S, P, seed=H + 3, odd=True)
    ref = ff.score_select(q, w, k, None, starts, ends, 1, dense=True)
    got = cu.score(q, w, k, None, starts, ends, q_blocks=q_blocks)
    vis = visible(starts, ends, P)
    a, b = got[vis].view(torch.int32), ref[vis].view(torch.int32)
    bad = int((a != b).sum())
    assert bad == 0, f"{bad} of {a.numel()} logits differ; first: {got[vis][a != b][:4]} vs {ref[vis][a != b][:4]}"


@pytest.mark.parametrize("H", [32, 64, 128])
def test_repeated_calls_and_the_nostore_mode(H):
    from sp_kpool.kernels import cuda_fp8_mqa as cu

    S, P = 4099, 8191
    q8, w, k8, scale = scorer_inputs(S, H, P, seed=H, case="random")
    starts, ends = scorer_ranges(S, P, seed=H + 1)
    first = cu.score(q8, w, k8, scale, starts, ends, q_blocks=2)
    for _ in range(3):
        assert torch.equal(cu.score(q8, w, k8, scale, starts, ends, q_blocks=2).view(torch.int32),
                           first.view(torch.int32))  # fmt: skip
    one = cu.score(q8, w, k8, scale, starts, ends, q_blocks=1)
    vis = visible(starts, ends, P)
    assert torch.equal(one[vis].view(torch.int32), first[vis].view(torch.int32))
    for q_blocks in (1, 2):
        assert cu.score(q8, w, k8, scale, starts, ends, mode="nostore", q_blocks=q_blocks) is None
    torch.cuda.synchronize()


def test_argument_errors_on_cuda_tensors():
    from sp_kpool.kernels import cuda_fp8_mqa as cu

    S, P = 8, 64
    q8, w, k8, scale = scorer_inputs(S, 32, P, seed=0, case="random")
    starts, ends = scorer_ranges(S, P, seed=0)
    with pytest.raises(ValueError, match="scales: its data must be 16-byte aligned"):
        cu.score(q8, w, k8, torch.cat([scale, scale])[1 : P + 1], starts, ends)
    with pytest.raises(TypeError, match="ks: expected dtype torch.int32, got torch.int64"):
        cu.score(q8, w, k8, scale, starts.long(), ends)
    with pytest.raises(ValueError, match=r"out: expected float32 \[S=8, >= P=64\]"):
        cu.score(q8, w, k8, scale, starts, ends, out=torch.empty(8, 63, device="cuda"))


@pytest.mark.parametrize("precision,backend,H", [("fp8", "deepgemm", 32), ("fp8", "deepgemm", 64),
                                                 ("fp8", "deepgemm", 128), ("bf16", "triton", 32)])
def test_whole_call_with_the_cuda_scorer_equals_the_default(precision, backend, H):
    # Settings.cuda_scorer (SP_KPOOL_CUDA_SCORER=1): the backend's chunks scored by the CUDA
    # scorer, the same ids bit for bit as its default scorer (DeepGEMM, or the Triton kernel
    # at H 128 and in BF16); a small budget for several chunks, and the clean path
    # (order="score": the reader needs -inf outside the ranges)
    import dataclasses

    from sp_kpool.pipeline import solve
    from sp_kpool.testing.problems import rank_slice_problem

    for order in ("ascending", "score"):
        p = rank_slice_problem(32768, 4, 3, heads=H, head_dim=128, topk=2048, precision=precision, device="cuda",
                               max_logits_bytes=256 * 2**20, order=order)  # fmt: skip
        want = solve(p, backend).ids
        got = solve(dataclasses.replace(p, settings=p.settings.replace(cuda_scorer=True)), backend).ids
        assert torch.equal(got, want), order
