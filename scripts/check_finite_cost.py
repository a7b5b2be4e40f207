"""The cost of ``check_finite=True`` on a CUDA host: the check alone, and a whole
world-size-1 call with and without it (one 32768-token document, H 32, D 128, topk 2048,
fp8 on the deepgemm backend; median of synchronized calls).

    python scripts/check_finite_cost.py

Prints one JSON line. Needs CUDA and deep_gemm (the GPU wheels: scripts/gpu_wheels.sh).
"""
import json, time, torch
from sp_kpool import ShardedSequence, kpool_topk
from sp_kpool.agreement import _check_finite

dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
S, H, D = 32768, 32, 128
bf = torch.bfloat16
t = {"q": torch.randn(S, H, D, generator=g, device=dev).to(bf), "k": torch.randn(S, D, generator=g, device=dev).to(bf),
     "gates": torch.randn(S, D, generator=g, device=dev).to(bf), "head_weights": torch.randn(S, H, generator=g, device=dev).float(),
     "ape": (torch.randn(4, D, generator=g, device=dev) * 0.5).to(bf)}
seq = ShardedSequence.split([0, S], 1, 0)

def ms(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize()
        out.append(1e3 * (time.perf_counter() - t0))
    out.sort()
    return round(out[len(out) // 2], 3)

res = {"check_alone_ms": ms(lambda: _check_finite(t, seq))}
for flag in (False, True, False, True):
    res.setdefault(f"whole_call_check_finite_{flag}_ms", []).append(
        ms(lambda: kpool_topk(**t, seq=seq, topk=2048, kpool=4, precision="fp8", backend="deepgemm", check_finite=flag), reps=10))
print(json.dumps(res))
