"""The CUDA scorer (``sp_kpool/kernels/cuda_fp8_mqa.cu``) against the scorer each backend uses
today, in one run: the decision data of issue #27's fused design (the design note's first GPU
steps: the fused path can reach <= 1.0x DeepGEMM only if the scorer itself, without stores
and with pool tiles shared by more rows, is well below DeepGEMM), and whether the BF16
variant beats the ``triton`` backend's Triton scorer (the BF16 whole-call target).

    python -m sp_kpool.bench cuda-scorer [--precisions fp8,bf16] [--heads 32,64] [--cases W,W262k] [--out DIR]

Cases as the ``fused`` case's (rank 3 of a 4-rank split, D 128, every row of the slice
in one call, the backend's prepared inputs): ``W`` one 131072-token document, ``W262k`` one
262144-token document. For each precision, case and H, by ``triton.testing.do_bench``: the
reference scorer (``fp8``: DeepGEMM ``fp8_mqa_logits``, legacy columns, ``clean_logits=False``,
as the deepgemm backend calls it; ``bf16``: the Triton kernel's dense mode, as the triton
backend calls it); the CUDA kernel dense (stores) and without stores, each with one and two
query blocks per pool tile; in FP8 the Triton kernel without stores (``scores_probe``); every
ratio to the reference; whether the dense logits equal the reference's bit for bit in every
row's range (``torch.equal`` of the int32 views); and the dense path's two largest stages,
scorer + the Triton selector (``k`` 512, as topk 2048 at kpool 4), with each scorer (ids
equal, times). Writes ``bench_cuda_scorer.json``; a failing arm is recorded with its error
and the run goes on. ``--profile``: one launch of each scorer for the first case, H and
precision, nothing timed or written (for ``ncu``: ``gpu_evidence.sh cudancu``).
"""

from __future__ import annotations

import time

import torch

from .inputs import prepared, slice_problem
from .record import command_line, environment, log, parser, require_cuda, save
from .timing import do_bench_ms

CASES = ("W", "W262k")


def inputs(case: str, H: int, precision: str):
    """The prepared inputs of the case's slice, every row in one call, as the backend that
    scores ``precision`` prepares them (``fp8``: deepgemm, ``bf16``: triton):
    ``(q, w, keys, scales, ks, ke)`` (``scales`` ``None`` in BF16)."""
    p = slice_problem(case, H, precision=precision, max_logits_bytes=2 * 2**30)
    return prepared(p, "deepgemm" if precision == "fp8" else "triton")[:6]


def in_range_equal(got: torch.Tensor, ref: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor) -> tuple[bool, int]:
    """Whether every in-range logit is equal bit for bit, and how many differ (row by row
    blocks, so no mask of the whole matrix is made)."""
    bad, P = 0, got.shape[1]
    cols = torch.arange(P, device=got.device)
    for r0 in range(0, got.shape[0], 2048):
        r1 = min(r0 + 2048, got.shape[0])
        vis = (cols[None] >= ks[r0:r1, None].long()) & (cols[None] < ke[r0:r1, None].long())
        a, b = got[r0:r1].view(torch.int32), ref[r0:r1, :P].view(torch.int32)
        bad += int(((a != b) & vis).sum())
    return bad == 0, bad


def one(case: str, H: int, precision: str) -> dict:
    """One case: the reference scorer (``fp8``: DeepGEMM ``fp8_mqa_logits``, legacy columns,
    ``clean_logits=False``, as the deepgemm backend calls it; ``bf16``: the Triton kernel's
    dense mode, as the triton backend calls it) against the CUDA kernel."""
    from ..kernels import cuda_fp8_mqa as cu
    from ..kernels import triton_fp8_fused as ff
    from ..kernels.triton_topk import topk_ascending

    t0 = time.perf_counter()
    q, w, k, sc, ks, ke = inputs(case, H, precision)
    P = k.shape[0]
    res = {"case": case, "H": H, "precision": precision, "rows": q.shape[0], "pools": P,
           "visible_mean": float((ke - ks).float().mean())}  # fmt: skip
    if precision == "fp8":
        import deep_gemm

        res["reference"] = "deepgemm"
        ref_fn = lambda: deep_gemm.fp8_mqa_logits(q, (k, sc), w, ks, ke, clean_logits=False)  # noqa: E731
    else:
        res["reference"] = "triton"
        ref_fn = lambda: ff.score_select(q, w, k, None, ks, ke, 1, dense=True, fill=None)  # noqa: E731
    res["reference_ms"] = do_bench_ms(ref_fn)
    ref = ref_fn()
    out = torch.empty(q.shape[0], P, dtype=torch.float32, device="cuda")
    for nqb in (1, 2):
        arm = f"cuda_dense_q{nqb}"
        try:
            out.fill_(float("nan"))
            cu.score(q, w, k, sc, ks, ke, q_blocks=nqb, out=out)
            torch.cuda.synchronize()
            res[f"{arm}_bitwise"], res[f"{arm}_differing"] = in_range_equal(out, ref, ks, ke)
            res[f"{arm}_ms"] = do_bench_ms(lambda: cu.score(q, w, k, sc, ks, ke, q_blocks=nqb, out=out))
        except Exception as exc:  # record and go on
            res[f"{arm}_error"] = f"{type(exc).__name__}: {exc}"[:600]
        arm = f"cuda_nostore_q{nqb}"
        try:
            res[f"{arm}_ms"] = do_bench_ms(lambda: cu.score(q, w, k, sc, ks, ke, mode="nostore", q_blocks=nqb))
        except Exception as exc:
            res[f"{arm}_error"] = f"{type(exc).__name__}: {exc}"[:600]
    # the dense path's two largest stages, scorer + the Triton selector (k = 512 pools, as the
    # whole call at topk 2048, kpool 4), with each scorer's logits: the same ids, and the time
    kp, base = 512, torch.zeros(q.shape[0], dtype=torch.int64, device="cuda")
    want = topk_ascending(ref[:, :P], ks, ke, base, kp)
    del ref
    res["reference_plus_select_ms"] = do_bench_ms(lambda: topk_ascending(ref_fn()[:, :P], ks, ke, base, kp))
    nqb = 2 if res.get("cuda_dense_q2_bitwise") else 1
    if res.get(f"cuda_dense_q{nqb}_bitwise"):
        cu.score(q, w, k, sc, ks, ke, q_blocks=nqb, out=out)
        res["cuda_plus_select_ids_equal"] = bool(torch.equal(topk_ascending(out, ks, ke, base, kp), want))
        res["cuda_plus_select_q_blocks"] = nqb
        res["cuda_plus_select_ms"] = do_bench_ms(
            lambda: topk_ascending(cu.score(q, w, k, sc, ks, ke, q_blocks=nqb, out=out), ks, ke, base, kp))  # fmt: skip
    del want
    if precision == "fp8":
        res["triton_nostore_ms"] = do_bench_ms(lambda: ff.scores_probe(q, w, k, sc, ks, ke))
    for key in [x for x in res if x.endswith("_ms") and x != "reference_ms"]:
        res[key.replace("_ms", "_over_reference")] = res[key] / res["reference_ms"]
    if "cuda_plus_select_ms" in res:
        res["cuda_plus_select_over_reference_plus_select"] = res["cuda_plus_select_ms"] / res["reference_plus_select_ms"]
    res["wall_s"] = time.perf_counter() - t0
    return res


def profile_launches(case: str, H: int, precision: str) -> None:
    """One launch of each scorer on the case's inputs, nothing timed: for a profiler that
    captures them (``--profile``; ``gpu_evidence.sh cudancu`` runs it under ``ncu``). Order:
    the reference, then the CUDA kernel dense and without stores, one and two query blocks."""
    from ..kernels import cuda_fp8_mqa as cu
    from ..kernels import triton_fp8_fused as ff

    q, w, k, sc, ks, ke = inputs(case, H, precision)
    if precision == "fp8":
        import deep_gemm

        deep_gemm.fp8_mqa_logits(q, (k, sc), w, ks, ke, clean_logits=False)
    else:
        ff.score_select(q, w, k, None, ks, ke, 1, dense=True, fill=None)
    out = torch.empty(q.shape[0], k.shape[0], dtype=torch.float32, device="cuda")
    for nqb in (1, 2):
        cu.score(q, w, k, sc, ks, ke, q_blocks=nqb, out=out)
        cu.score(q, w, k, sc, ks, ke, mode="nostore", q_blocks=nqb)
    torch.cuda.synchronize()
    log({"profiled": case, "H": H, "precision": precision})


def main(argv=None) -> int:
    ap = parser("cuda-scorer", __doc__)
    ap.add_argument("--heads", default="32,64")
    ap.add_argument("--cases", default="W,W262k")
    ap.add_argument("--precisions", default="fp8,bf16")
    ap.add_argument("--out", default=".")
    ap.add_argument("--profile", action="store_true",
                    help="one launch of each scorer for the first case, H and precision, nothing timed (under ncu)")
    args = ap.parse_args(argv)
    bad = sorted(set(args.cases.split(",")) - set(CASES))
    if bad:
        ap.error(f"--cases: expected names from {list(CASES)}, got {bad}")
    require_cuda("cuda-scorer")
    if args.profile:
        profile_launches(args.cases.split(",")[0], int(args.heads.split(",")[0]), args.precisions.split(",")[0])
        return 0
    doc = {"environment": environment(command_line("cuda-scorer", argv), packages=("triton", "tilelang", "deep_gemm",
                                                                                  "lmdeploy")),
           "args": vars(args), "results": []}  # fmt: skip
    for precision in args.precisions.split(","):
        for case in args.cases.split(","):
            for H in map(int, args.heads.split(",")):
                try:
                    r = one(case, H, precision)
                except Exception as exc:  # one failing case must not lose the rest
                    r = {"case": case, "H": H, "precision": precision, "error": f"{type(exc).__name__}: {exc}"[:600]}
                log(r)
                doc["results"].append(r)
                save(doc, args.out, "bench_cuda_scorer.json")
    return 0
