"""Per-line host time of one cold whole FP8 call (H 32, rank-3 slice), up to the first
DeepGEMM call: sys.settrace line events in sp_kpool's files (each event adds ~1 us), the
time of a line = until the next event. Also the call untraced, for scale."""
import os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from sp_kpool.backends import BACKENDS
from sp_kpool.testing.problems import reference_slice_problem
import deep_gemm
p = reference_slice_problem(32, "fp8", total=131072, seed=32)
be = BACKENDS["deepgemm"]
for _ in range(3):
    be.run(p)
torch.cuda.synchronize()
for _ in range(3):
    t0 = time.perf_counter(); be.run(p); t1 = time.perf_counter(); torch.cuda.synchronize()
    print(f"untraced cold call host {1e6 * (t1 - t0):.0f} us", flush=True)
ev = []
root = os.path.join(os.getcwd(), "sp_kpool")
def tracer(frame, event, arg):
    if not frame.f_code.co_filename.startswith(root):
        return None
    def local(frame, event, arg):
        if event in ("line", "return"):
            ev.append((time.perf_counter(), f"{os.path.relpath(frame.f_code.co_filename, root)}:{frame.f_lineno} {event}"))
        return local
    ev.append((time.perf_counter(), f"{os.path.relpath(frame.f_code.co_filename, root)}:{frame.f_lineno} call {frame.f_code.co_name}"))
    return local
orig = deep_gemm.fp8_mqa_logits
def dg(*a, **k):
    ev.append((time.perf_counter(), "DEEPGEMM CALL"))
    return orig(*a, **k)
deep_gemm.fp8_mqa_logits = dg
from sp_kpool.backends import deepgemm_backend as DGB
DGB.mqa_api.cache_clear()
be.run(p); torch.cuda.synchronize()
for rep in range(2):
    ev.clear()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    sys.settrace(tracer)
    be.run(p)
    sys.settrace(None)
    torch.cuda.synchronize()
    stop = next(i for i, (_, s) in enumerate(ev) if s == "DEEPGEMM CALL")
    print(f"rep {rep}: traced, DeepGEMM entered at {1e6 * (ev[stop][0] - t0):.0f} us after {stop} events")
    if rep == 1:
        rows = [(ev[i + 1][0] - ev[i][0], ev[i][1]) for i in range(stop)]
        for dt, s in rows:
            if dt > 8e-6:
                print(f"  {1e6 * dt:7.1f} us  {s}")
