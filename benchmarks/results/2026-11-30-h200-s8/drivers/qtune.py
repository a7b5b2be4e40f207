"""queries_fp8 launch sizes on the slice queries (32768 x H x 128 bf16): time and equality
with the default launch; and host costs of the steps before the first DeepGEMM call
(device busy: a sleep queued first, perf_counter around N calls of each)."""
import os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import torch
from bench_kernels import bench
from sp_kpool.backends import BACKENDS
from sp_kpool.backends.base import stage_tables
from sp_kpool.kernels.triton_serving import queries_fp8, pools_serving
from sp_kpool.kernels import triton_select as ts
from sp_kpool.testing.problems import reference_slice_problem
for H in (32, 64):
    p = reference_slice_problem(H, "fp8", total=131072, seed=H)
    ref = queries_fp8(p.q, p.head_weights)
    for blk in (32, 64, 128, 256, 512):
        try:
            got = queries_fp8(p.q, p.head_weights, block=blk)
            eq = all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a, b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b) for a, b in zip(got, ref))
            ms = bench(lambda: queries_fp8(p.q, p.head_weights, block=blk), reps=10)
            print(f"H={H} queries_fp8 block={blk} {ms * 1e3:.1f} us equal={eq}", flush=True)
        except Exception as exc:
            print(f"H={H} block={blk} error {type(exc).__name__}: {str(exc)[:200]}", flush=True)
be = BACKENDS["deepgemm"]
p = reference_slice_problem(32, "fp8", total=131072, seed=32)
be.run(p); torch.cuda.synchronize()
seq = p.seq
lo_row, hi_row = seq.shard_start, min(seq.shard_end, seq.num_real_tokens)
st = stage_tables(be, p, lo_row, hi_row)
pooled = be.pool(p, st.pool_tok_start)
q8, wq = be.prepare_queries(p, p.q, p.head_weights)
g0, g1, lo, hi = st.grid[1]
C = st.C
r_s, r_e = st.ranges[0, C : 2 * C], st.ranges[1, C : 2 * C]
qc, wc = q8[g0 - lo_row : g0 - lo_row + C], wq[g0 - lo_row : g0 - lo_row + C]
from sp_kpool.backends.deepgemm_backend import mqa_api
fn, _ = mqa_api()
kv = (pooled[0][lo:hi], pooled[1][lo:hi])
steps = {
    "torch.empty": lambda: torch.empty(16, device="cuda"),
    "queries_fp8": lambda: be.prepare_queries(p, p.q, p.head_weights),
    "stage_tables (cached)": lambda: stage_tables(be, p, lo_row, hi_row),
    "pool (pools_serving)": lambda: be.pool(p, st.pool_tok_start),
    "F.pad q chunk": lambda: torch.nn.functional.pad(q8[: C - 768], (0, 0, 0, 0, 768, 0)),
    "score_prepared (whole chunk)": lambda: be.score_prepared(p, pooled, qc, wc, lo, hi, r_s, r_e),
    "fp8_mqa_logits alone": lambda: fn(qc, kv, wc, r_s, r_e, clean_logits=False),
    "topk_ascending (chunk)": None,
}
logits = fn(qc, kv, wc, r_s, r_e, clean_logits=False)[:, : hi - lo]
zero = torch.zeros(C, dtype=torch.int64, device="cuda")
steps["topk_ascending (chunk)"] = lambda: ts.topk_ascending(logits, r_s, r_e, zero, 512)
for name, f in steps.items():
    f(); torch.cuda.synchronize()
    n = 5 if "score" in name or "mqa" in name or "topk" in name else 20
    torch.cuda._sleep(200_000_000)
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    dt = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    print(f"host {name:32s} {dt * 1e6:8.1f} us per call", flush=True)
