"""The split fractions on bench_select's logits (16384 x 32768, k 512; ReLU-sum random and
levels 7 / 1000), each configuration checked against the exact int64-key rule."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import torch
from bench_select import make_logits, exact, bench
from sp_kpool.kernels import triton_select as ts
cfgs = {"no splits": dict(split2=(), split4=()), "default": {}, "split4 only": dict(split2=())}
for levels in (0, 7, 1000):
    s, ends = make_logits(16384, 32768, levels, 0)
    starts = torch.zeros_like(ends)
    base = torch.full((16384,), 1000, dtype=torch.int64, device="cuda")
    want = exact(s, ends, 512, 1000)
    for name, kw in cfgs.items():
        got = ts.topk_ascending(s, starts, ends, base, 512, **kw)
        ms = [round(bench(lambda: ts.topk_ascending(s, starts, ends, base, 512, **kw)), 3) for _ in range(2)]
        print(f"levels={levels} {name} {kw} equal_exact={torch.equal(got, want)} {ms} ms", flush=True)
    del s, want; torch.cuda.empty_cache()
