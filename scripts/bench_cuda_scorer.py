"""The CUDA FP8 scorer (``sp_kpool/kernels/cuda_fp8_mqa.cu``) against DeepGEMM alone, in one run:
the decision data of issue #27's fused design (the design note's first GPU steps: the fused
path can reach <= 1.0x DeepGEMM only if the scorer itself, without stores and with pool
tiles shared by more rows, is well below DeepGEMM).

    python scripts/bench_cuda_scorer.py [--heads 32,64] [--cases W,W262k] [--out DIR]

Cases as ``scripts/bench_fused.py`` (rank 3 of a 4-rank split, D 128, every row of the slice
in one call, the deepgemm backend's prepared inputs): ``W`` one 131072-token document,
``W262k`` one 262144-token document. For each case and H, by ``triton.testing.do_bench``:
DeepGEMM ``fp8_mqa_logits`` (legacy columns, ``clean_logits=False``, as the backend calls
it); the CUDA kernel dense (stores, as DeepGEMM) and without stores, each with one and two
query blocks per pool tile; the Triton kernel without stores (``scores_probe``) for
reference; every ratio to DeepGEMM; whether the dense logits equal DeepGEMM's bit for bit
in every row's range (``torch.equal`` of the int32 views); and the dense path's two largest
stages, scorer + the Triton selector (``k`` 512, as topk 2048 at kpool 4), with DeepGEMM and
with the CUDA kernel where its logits are DeepGEMM's (ids equal, times). Writes
``bench_cuda_scorer.json``; a failing arm is recorded with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from sp_kpool.testing.bench_timing import do_bench_ms, log, package_versions, save

CASES = {"W": 131072, "W262k": 262144}


def inputs(total: int, H: int):
    """The prepared FP8 inputs of the case's slice: ``(q8, w, k8, k_scale, ks, ke)``."""
    from bench_fused import prepared  # scripts/ is on sys.path when this script runs

    from sp_kpool.testing.problems import rank_slice_problem

    p = rank_slice_problem(total, 4, 3, heads=H, head_dim=128, topk=2048, precision="fp8", device="cuda",
                           max_logits_bytes=2 * 2**30)  # fmt: skip
    return prepared(p)[:6]


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


def one(case: str, H: int) -> dict:
    import deep_gemm

    from sp_kpool.kernels import cuda_fp8_mqa as cu
    from sp_kpool.kernels import triton_fp8_fused as ff

    t0 = time.perf_counter()
    q8, w, k8, sc, ks, ke = inputs(CASES[case], H)
    res = {"case": case, "H": H, "rows": q8.shape[0], "pools": k8.shape[0],
           "visible_mean": float((ke - ks).float().mean())}  # fmt: skip
    dg = lambda: deep_gemm.fp8_mqa_logits(q8, (k8, sc), w, ks, ke, clean_logits=False)  # noqa: E731
    res["deepgemm_ms"] = do_bench_ms(dg)
    ref = dg()
    out = torch.empty(q8.shape[0], k8.shape[0], dtype=torch.float32, device="cuda")
    for nqb in (1, 2):
        arm = f"cuda_dense_q{nqb}"
        try:
            out.fill_(float("nan"))
            cu.score(q8, w, k8, sc, ks, ke, q_blocks=nqb, out=out)
            torch.cuda.synchronize()
            res[f"{arm}_bitwise"], res[f"{arm}_differing"] = in_range_equal(out, ref, ks, ke)
            res[f"{arm}_ms"] = do_bench_ms(lambda: cu.score(q8, w, k8, sc, ks, ke, q_blocks=nqb, out=out))
        except Exception as exc:  # record and go on
            res[f"{arm}_error"] = f"{type(exc).__name__}: {exc}"[:600]
        arm = f"cuda_nostore_q{nqb}"
        try:
            res[f"{arm}_ms"] = do_bench_ms(lambda: cu.score(q8, w, k8, sc, ks, ke, mode="nostore", q_blocks=nqb))
        except Exception as exc:
            res[f"{arm}_error"] = f"{type(exc).__name__}: {exc}"[:600]
    # the dense path's two largest stages, scorer + the Triton selector (k = 512 pools, as the
    # whole call at topk 2048, kpool 4), each scorer's logits: the same ids, and the time
    from sp_kpool.kernels.triton_topk import topk_ascending

    kp, base = 512, torch.zeros(q8.shape[0], dtype=torch.int64, device="cuda")
    want = topk_ascending(ref[:, : k8.shape[0]], ks, ke, base, kp)
    del ref
    res["deepgemm_plus_select_ms"] = do_bench_ms(
        lambda: topk_ascending(dg()[:, : k8.shape[0]], ks, ke, base, kp))  # fmt: skip
    nqb = 2 if res.get("cuda_dense_q2_bitwise") else 1
    if res.get(f"cuda_dense_q{nqb}_bitwise"):
        cu.score(q8, w, k8, sc, ks, ke, q_blocks=nqb, out=out)
        res["cuda_plus_select_ids_equal"] = bool(torch.equal(topk_ascending(out, ks, ke, base, kp), want))
        res["cuda_plus_select_q_blocks"] = nqb
        res["cuda_plus_select_ms"] = do_bench_ms(
            lambda: topk_ascending(cu.score(q8, w, k8, sc, ks, ke, q_blocks=nqb, out=out), ks, ke, base, kp))  # fmt: skip
    del want
    res["triton_nostore_ms"] = do_bench_ms(lambda: ff.scores_probe(q8, w, k8, sc, ks, ke))
    for key in [k for k in res if k.endswith("_ms") and k != "deepgemm_ms"]:
        res[key.replace("_ms", "_over_deepgemm")] = res[key] / res["deepgemm_ms"]
    if "cuda_plus_select_ms" in res:
        res["cuda_plus_select_over_deepgemm_plus_select"] = res["cuda_plus_select_ms"] / res["deepgemm_plus_select_ms"]
    res["wall_s"] = time.perf_counter() - t0
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="32,64")
    ap.add_argument("--cases", default="W,W262k")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    doc = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "versions": package_versions(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "results": []}  # fmt: skip
    for case in args.cases.split(","):
        for H in map(int, args.heads.split(",")):
            try:
                r = one(case, H)
            except Exception as exc:  # one failing case must not lose the rest
                r = {"case": case, "H": H, "error": f"{type(exc).__name__}: {exc}"[:600]}
            log(r)
            doc["results"].append(r)
            save(doc, args.out, "bench_cuda_scorer.json")


if __name__ == "__main__":
    main()
