"""GPU timeline (CUDA activity only: no CPU op recording) of one whole FP8 indexer call (deepgemm backend, rank-3 slice, H 32):
kernels in order with start offset, duration and the idle gap before each."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
from torch.profiler import profile, ProfilerActivity
from sp_kpool.backends import BACKENDS
from sp_kpool.testing.problems import reference_slice_problem
H = int(sys.argv[1]) if len(sys.argv) > 1 else 32
p = reference_slice_problem(H, "fp8", total=131072, seed=H)
be = BACKENDS["deepgemm"]
for _ in range(3):
    be.run(p)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    be.run(p)
    torch.cuda.synchronize()
ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
ev.sort(key=lambda e: e.time_range.start)
t0 = ev[0].time_range.start
prev_end = t0
print(f"{'start_us':>9} {'dur_us':>8} {'gap_us':>7}  kernel")
for e in ev:
    s, d = e.time_range.start, e.time_range.elapsed_us()
    print(f"{s - t0:9.1f} {d:8.1f} {s - prev_end:7.1f}  {e.name[:90]}")
    prev_end = max(prev_end, e.time_range.end)
print(f"total span {prev_end - t0:.1f} us, kernels {sum(e.time_range.elapsed_us() for e in ev):.1f} us")
cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cuda") is False]
