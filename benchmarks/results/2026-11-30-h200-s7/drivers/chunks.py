"""Whole FP8 call (table cache on) for three chunk sizes of the global grid: the default
budget (16256 rows), a budget that makes 16384-row chunks (rank 3 of 4 x 32768: two full
chunks) and 8192-row chunks (four), interleaved; outputs compared with the default's."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import torch
from bench_kernels import bench, bench_host_ahead
from sp_kpool.backends import BACKENDS
from sp_kpool.backends.deepgemm_backend import _layout, legacy_alignment
from sp_kpool.logits_budget import logits_bytes
from sp_kpool.testing.problems import reference_slice_problem
be = BACKENDS["deepgemm"]
for H in (32, 64):
    base = reference_slice_problem(H, "fp8", total=131072, seed=H)
    P = 131072 // 4
    probs = {"default": base}
    for rows in (16384, 8192):
        b = logits_bytes(rows, P, H, _layout(), legacy_alignment(0))
        import dataclasses
        probs[f"C{rows}"] = dataclasses.replace(base, max_logits_bytes=b)
    ref = be.run(base).clone()
    for name, p in probs.items():
        print(f"H={H} {name}: chunk rows {be.chunk_rows(p, P)}, equal to default: {torch.equal(be.run(p), ref)}", flush=True)
    for rep in range(3):
        for name, p in probs.items():
            ms = bench(lambda: be.run(p), reps=7, warmup=1)
            ahead, host = bench_host_ahead(lambda: be.run(p), reps=5)
            print(f"H={H} {name} rep{rep} whole {ms:.3f} ms host-ahead {ahead:.3f} ms", flush=True)
    del base, probs; torch.cuda.empty_cache()
