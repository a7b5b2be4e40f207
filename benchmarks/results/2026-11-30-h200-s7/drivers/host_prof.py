"""cProfile of one whole FP8 call while the device is busy, plus per-op host costs."""
import cProfile, os, pstats, sys, time, io
sys.path.insert(0, os.getcwd())
import torch, triton, triton.language as tl
from sp_kpool.backends import BACKENDS
from sp_kpool.testing.problems import reference_slice_problem
p = reference_slice_problem(32, "fp8", total=131072, seed=32)
be = BACKENDS["deepgemm"]
for _ in range(2):
    be.run(p)
torch.cuda.synchronize()
def timeit(label, f, n=200):
    torch.cuda._sleep(200_000_000)
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    print(f"{label:40s} {dt:7.1f} us")
x = torch.zeros(1000, device="cuda")
timeit("torch.empty cuda", lambda: torch.empty(1000, device="cuda"))
timeit("x + 1", lambda: x + 1)
timeit("torch.arange cuda", lambda: torch.arange(1000, device="cuda"))
idx = torch.zeros(10, dtype=torch.int64, device="cuda")
timeit("x[idx]", lambda: x[idx])
timeit("int(cpu_tensor[-1])", lambda: int(p.seq.cu_seq_lens[-1]))
@triton.jit
def k0(X, n):
    tl.store(X + tl.arange(0, 16), tl.arange(0, 16).to(tl.float32), mask=tl.arange(0, 16) < n)
timeit("triton launch (2 args)", lambda: k0[(1,)](x, 5))
from sp_kpool.kernels.triton_serving import queries_fp8
n = p.q.shape[0]
timeit("queries_fp8", lambda: queries_fp8(p.q, p.head_weights), n=50)
from sp_kpool.backends.base import stage_tables
timeit("stage_tables", lambda: stage_tables(be, p, p.seq.shard_start, p.seq.shard_end), n=50)
pr = cProfile.Profile()
torch.cuda._sleep(100_000_000)
pr.enable()
for _ in range(5):
    be.run(p)
pr.disable()
torch.cuda.synchronize()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(45)
print(s.getvalue()[:12000])
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(60)
print(s.getvalue()[:14000])
