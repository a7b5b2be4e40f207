"""Calls of the whole FP8 indexer queued back to back (as triton.testing.do_bench and a
model's forward pass queue them): host time of each call and where the host waits
(perf_counter stamps around the driver's steps), device time per call."""
import functools, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
import deep_gemm
from sp_kpool.backends import BACKENDS
from sp_kpool.backends import base as B
from sp_kpool.backends import deepgemm_backend as DGB
from sp_kpool import selection as SEL
from sp_kpool.kernels import triton_select as TS
from sp_kpool.kernels import triton_serving as TSV
from sp_kpool.testing.problems import reference_slice_problem
stamps = []
def wrap(mod, name):
    f = getattr(mod, name)
    @functools.wraps(f)
    def g(*a, **k):
        t0 = time.perf_counter(); r = f(*a, **k); stamps.append((name, time.perf_counter() - t0)); return r
    setattr(mod, name, g)
for mod, name in ((B, "stage_tables"), (B, "select_rows"), (B, "row_meta"), (B, "assemble"), (B, "select_pools"), (B, "pool_and_prepare_rows"),
                  (TS, "topk_ascending"), (TS, "expand_pools"), (TSV, "prepare_fp8"), (deep_gemm, "fp8_mqa_logits"), (SEL, "expand_pools") if hasattr(SEL, "expand_pools") else (TS, "expand_pools")):
    wrap(mod, name)
DGB.mqa_api.cache_clear()
be = BACKENDS["deepgemm"]
p = reference_slice_problem(32, "fp8", total=131072, seed=32)
for _ in range(3):
    be.run(p)
torch.cuda.synchronize()
cache = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
for flush in (True, False):
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(8)]
    host = []
    stamps.clear()
    torch.cuda.synchronize()
    for a, b in ev:
        if flush:
            cache.zero_()
        a.record()
        t0 = time.perf_counter()
        be.run(p)
        host.append(1e3 * (time.perf_counter() - t0))
        b.record()
    torch.cuda.synchronize()
    dev = [a.elapsed_time(b) for a, b in ev]
    print(f"flush={flush} host ms per call {[round(h, 2) for h in host]}")
    print(f"flush={flush} device ms per call {[round(d, 3) for d in dev]}")
    slow = sorted(stamps, key=lambda s: -s[1])[:8]
    print("slowest steps:", [(n, round(1e3 * t, 3)) for n, t in slow])
