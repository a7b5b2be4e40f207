"""The whole FP8 indexer (H 32 slice) with dc151bb's selector (ts_prev) and the working
tree's, by do_bench, in alternating order; outputs compared."""
import os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import torch
from bench_kernels import bench_do_bench
from sp_kpool.backends import BACKENDS
from sp_kpool.kernels import triton_select as ts
sys.path.insert(0, os.path.join(os.getcwd(), "gpu11"))
import ts_prev
from sp_kpool.testing.problems import reference_slice_problem
p = reference_slice_problem(32, "fp8", total=131072, seed=32)
be = BACKENDS["deepgemm"]
new_fn = ts.topk_ascending
def use(arm):
    ts.topk_ascending = ts_prev.topk_ascending if arm == "prev" else new_fn
outs = {}
for arm in ("prev", "new"):
    use(arm); outs[arm] = be.run(p).clone()
print("whole outputs equal:", torch.equal(outs["prev"], outs["new"]), flush=True)
res = {}
for rep in range(4):
    for arm in (("prev", "new") if rep % 2 == 0 else ("new", "prev")):
        time.sleep(1.0)
        use(arm)
        res.setdefault(arm, []).append(round(bench_do_bench(lambda: be.run(p)), 3))
print({k: v for k, v in res.items()}, flush=True)
