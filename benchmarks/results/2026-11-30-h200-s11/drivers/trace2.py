"""GPU timeline of one whole FP8 indexer call (deepgemm backend, rank-3 slice, H 32) with the
host ahead (a 20 ms device sleep queued first): kernels in order with start offset,
duration and the idle gap before each, then the total per kernel name."""
import collections, os, sys
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
    torch.cuda._sleep(20_000_000)
    be.run(p)
    torch.cuda.synchronize()
ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "sleep" not in e.name]
ev.sort(key=lambda e: e.time_range.start)
t0 = ev[0].time_range.start
prev_end = t0
tot = collections.Counter()
print(f"{'start_us':>9} {'dur_us':>8} {'gap_us':>7}  kernel")
for e in ev:
    s, d = e.time_range.start, e.time_range.elapsed_us()
    print(f"{s - t0:9.1f} {d:8.1f} {s - prev_end:7.1f}  {e.name[:100]}")
    prev_end = max(prev_end, e.time_range.end)
    tot[e.name[:60]] += d
print(f"total span {prev_end - t0:.1f} us, kernels {sum(e.time_range.elapsed_us() for e in ev):.1f} us")
for n, d in tot.most_common():
    print(f"{d:9.1f} us  {n}")
