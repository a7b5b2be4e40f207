"""A/B of the committed selector (gpu7/ts_old.py = HEAD) and the working tree's, on the
logits of bench_select.py, interleaved, each checked against the exact int64 Top-K."""
import json, os, sys, importlib.util
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import torch
from bench_select import make_logits, exact, bench
from sp_kpool.kernels import triton_select as new
spec = importlib.util.spec_from_file_location("ts_old", "gpu7/ts_old.py"); old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
rows, pools, k = int(os.environ.get("ROWS", 16384)), 32768, 512
cfgs = [("old", old, {}), ("new", new, {})] + [(c, new, dict(kv.split("=") for kv in c.split("+"))) for c in sys.argv[1:]]
def conv(d): return {a: int(b) if b.lstrip("-").isdigit() else b for a, b in d.items()}
out = {}
for levels in (0, 7, 1000):
    s, ends = make_logits(rows, pools, levels, seed=levels)
    starts = torch.zeros_like(ends); base = torch.full((rows,), 1000, dtype=torch.int64, device="cuda")
    ref = exact(s, ends, k, 1000)
    for rep in range(2):
        for name, mod, kw in cfgs:
            kw = conv(kw)
            f = lambda: mod.topk_ascending(s, starts, ends, base, k, **kw)
            ok = torch.equal(f(), ref)
            ms = bench(f)
            out.setdefault(f"levels={levels} {name}", []).append(ms)
            print(f"levels={levels} {name:40s} rep{rep} {ms:.3f} ms equal={ok} {dict(mod.last_launch) if rep == 0 else ''}", flush=True)
    del s, ref; torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "ab.json"), "w"), indent=1)
