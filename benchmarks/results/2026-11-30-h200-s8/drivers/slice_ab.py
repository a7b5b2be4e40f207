"""Selector launches on the DeepGEMM logits of the rank-3 slice (bench_kernels' workload),
interleaved, each compared with the committed selector's answer (gpu8/ts_old.py = HEAD)."""
import json, os, sys, importlib.util
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import torch
from bench_kernels import bench
from sp_kpool.backends.deepgemm_backend import mqa_api
from sp_kpool.kernels import triton_select as new
from sp_kpool.kernels.triton_serving import pools_serving, queries_fp8
from sp_kpool.pooling import pool_table
from sp_kpool.selection import row_meta
from sp_kpool.testing.problems import reference_slice_problem
spec = importlib.util.spec_from_file_location("ts_old", "gpu8/ts_old.py"); old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
def conv(c): return {a: int(b) if b.lstrip("-").isdigit() else b for a, b in (kv.split("=") for kv in c.split("+"))}
cfgs = [("old", old, {}), ("new", new, {})] + [(c, new, conv(c)) for c in sys.argv[2:]]
res = {}
for H in [int(h) for h in sys.argv[1].split(",")]:
    p = reference_slice_problem(H, "fp8", total=131072, seed=H)
    fn, _ = mqa_api()
    stt, offs = pool_table(p.seq.real_cu_seq_lens, 4)
    k8, ks = pools_serving(p.k, p.gates, p.ape, stt.cuda(), fp8=True)
    q8, wq = queries_fp8(p.q, p.head_weights)
    m = row_meta(torch.arange(p.seq.shard_start, p.seq.shard_end), p.seq.real_cu_seq_lens, offs, 4)
    s, e = m.pool_lo.int().cuda(), m.pool_hi.int().cuda()
    logits = fn(q8, (k8, ks), wq, s, e, clean_logits=True)[:, : k8.shape[0]]
    zero = torch.zeros(logits.shape[0], dtype=torch.int64, device="cuda")
    ref = old.topk_ascending(logits, s, e, zero, 512)
    for rep in range(3):
        for name, mod, kw in cfgs:
            f = lambda: mod.topk_ascending(logits, s, e, zero, 512, **kw)
            ok = torch.equal(f(), ref)
            ms = bench(f, reps=5)
            res.setdefault(f"H{H} {name}", []).append(ms)
            print(f"H={H} {name:32s} rep{rep} {ms:.3f} ms equal={ok} {dict(mod.last_launch) if rep == 0 else ''}", flush=True)
    del logits, p, k8, q8, wq; torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "slice_ab.json"), "w"), indent=1)
