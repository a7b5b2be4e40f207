"""expand_pools rows per program (triton_select._EXPAND_ROWS): the kernel alone on the
selected pools of the H 32 slice, and the whole FP8 indexer with each, interleaved."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import torch
from bench_kernels import bench, bench_do_bench
from sp_kpool.backends import BACKENDS
from sp_kpool.kernels import triton_select as ts
from sp_kpool.testing.problems import reference_slice_problem
RPP = [int(v) for v in sys.argv[1].split(",")]
p = reference_slice_problem(32, "fp8", total=131072, seed=32)
be = BACKENDS["deepgemm"]
outs = {}
for r in RPP:
    ts._EXPAND_ROWS = r
    outs[r] = be.run(p).clone()
print("whole outputs equal across rows per program:", all(torch.equal(outs[RPP[0]], o) for o in outs.values()), flush=True)
# the kernel alone: random valid pools in ascending order, fixed tail
R, k, K = 32768, 512, 4
g = torch.Generator(device="cuda").manual_seed(0)
pools = torch.sort(torch.randint(0, 24000, (R, k), device="cuda", generator=g), dim=1).values.int()
rows = torch.arange(98304, 98304 + R, device="cuda", dtype=torch.int64)
tail = torch.full((R,), 3, device="cuda", dtype=torch.int64)
hi = rows // 4
for tailmode in ("fixed", "compact"):
    ref = None
    for r in RPP:
        ts._EXPAND_ROWS = r
        out = torch.empty((R, 2048 + 64), dtype=torch.int32, device="cuda")
        ts.expand_pools(pools, rows, tail, hi, out, topk=2048, kpool=K, tail=tailmode)
        ref = out.clone() if ref is None else ref
        ms = [bench_do_bench(lambda: ts.expand_pools(pools, rows, tail, hi, out, topk=2048, kpool=K, tail=tailmode)) for _ in range(2)]
        print(f"expand {tailmode} rows/program {r}: equal {torch.equal(out, ref)} {[round(m * 1e3, 1) for m in ms]} us", flush=True)
for rep in range(3):
    for r in RPP:
        ts._EXPAND_ROWS = r
        print(f"rep{rep} rows/program {r} whole do_bench {bench_do_bench(lambda: be.run(p)):.3f} ms", flush=True)
