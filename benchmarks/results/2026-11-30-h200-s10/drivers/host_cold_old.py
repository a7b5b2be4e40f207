"""Host timeline of one whole FP8 call, cold (after a synchronize, device idle) and busy (a sleep queued first):
perf_counter stamps at entry/exit of the driver's steps, relative to the call start."""
import functools, os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "gpu10/old"))
import torch
import deep_gemm
from sp_kpool_old.backends import BACKENDS
from sp_kpool_old.backends import base as B
from sp_kpool_old.backends import deepgemm_backend as DGB
from sp_kpool_old import selection as SEL
from sp_kpool_old.kernels import triton_select as TS
from sp_kpool_old.kernels import triton_serving as TSV
from sp_kpool_old.testing.problems import reference_slice_problem
stamps = []
def wrap(mod, name, label=None):
    f = getattr(mod, name)
    @functools.wraps(f)
    def g(*a, **k):
        stamps.append((time.perf_counter(), ">" + (label or name)))
        r = f(*a, **k)
        stamps.append((time.perf_counter(), "<" + (label or name)))
        return r
    setattr(mod, name, g)
be = BACKENDS["deepgemm"]
for mod, name in ((B, "stage_tables"), (B, "select_rows"), (B, "row_meta"), (B, "assemble"), (B, "select_pools"), (TS, "chunk_row_ranges"),
                  (TS, "topk_ascending"), (TS, "expand_pools"), (TSV, "pools_serving"), (TSV, "queries_fp8"), (TSV, "prepare_fp8"), (deep_gemm, "fp8_mqa_logits")):
    if hasattr(mod, name):
        wrap(mod, name)
DGB.mqa_api.cache_clear()
for name in ("prepare_queries", "pool", "pool_and_prepare", "score_prepared"):
    orig = getattr(type(be), name, None)
    if orig is None:
        continue
    def mk(orig, name):
        def g(self, *a, **k):
            stamps.append((time.perf_counter(), ">" + name)); r = orig(self, *a, **k); stamps.append((time.perf_counter(), "<" + name)); return r
        return g
    setattr(type(be), name, mk(orig, name))
p = reference_slice_problem(int(sys.argv[1]) if len(sys.argv) > 1 else 32, "fp8", total=131072, seed=32)
for _ in range(2):
    be.run(p)
torch.cuda.synchronize()
for mode in ("busy", "cold", "busy", "cold"):
    stamps.clear()
    torch.cuda.synchronize()
    if mode == "busy":
        torch.cuda._sleep(40_000_000)
    t0 = time.perf_counter()
    be.run(p)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    first_dg = next((t for t, s in stamps if s == ">fp8_mqa_logits"), t0)
    print(f"{mode}: whole call host {1e3 * (t1 - t0):.3f} ms, first fp8_mqa_logits entered at {1e6 * (first_dg - t0):.1f} us")
    for t, s in stamps[:12]:
        print(f"  {1e6 * (t - t0):8.1f} us {s}")
