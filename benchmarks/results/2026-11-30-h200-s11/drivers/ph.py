"""The final selector's phases on the DeepGEMM logits of the H 32 slice (phases 1, 1-3, all),
and launch variants (maxnreg 64: 4 programs per SM), against the committed one (ts_old)."""
import os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import torch
from bench_kernels import bench
from sp_kpool.kernels import triton_select as ts
sys.path.insert(0, os.path.join(os.getcwd(), "gpu11"))
import ts_old
from sp_kpool.testing.problems import reference_slice_problem
from sp_kpool.backends.deepgemm_backend import mqa_api
from sp_kpool.kernels.triton_serving import pools_serving, queries_fp8
from sp_kpool.pooling import pool_table
from sp_kpool.selection import row_meta
p = reference_slice_problem(32, "fp8", total=131072, seed=32)
fn, _ = mqa_api()
stt, offs = pool_table(p.seq.real_cu_seq_lens, 4)
k8, ks = pools_serving(p.k, p.gates, p.ape, stt.cuda(), fp8=True)
q8, wq = queries_fp8(p.q, p.head_weights)
m = row_meta(torch.arange(p.seq.shard_start, p.seq.shard_end), p.seq.real_cu_seq_lens, offs, 4)
s, e = m.pool_lo.int().cuda(), m.pool_hi.int().cuda()
logits = fn(q8, (k8, ks), wq, s, e, clean_logits=True)[:, : k8.shape[0]]
zero = torch.zeros(logits.shape[0], dtype=torch.int64, device="cuda")
ref = ts_old.topk_ascending(logits, s, e, zero, 512)
for kw in (dict(maxnreg=64), dict(maxnreg=72)):
    got = ts.topk_ascending(logits, s, e, zero, 512, **kw)
    print(kw, "equal", torch.equal(got, ref), ts.last_launch, flush=True)
res = {}
for rep in range(3):
    time.sleep(0.5)
    for name, f in (("old all", lambda: ts_old.topk_ascending(logits, s, e, zero, 512)),
                    ("old phase 1", lambda: ts_old.topk_ascending(logits, s, e, zero, 512, phases=1)),
                    ("old phases 1-3", lambda: ts_old.topk_ascending(logits, s, e, zero, 512, phases=3)),
                    ("new all", lambda: ts.topk_ascending(logits, s, e, zero, 512)),
                    ("new phase 1", lambda: ts.topk_ascending(logits, s, e, zero, 512, phases=1)),
                    ("new phases 1-3", lambda: ts.topk_ascending(logits, s, e, zero, 512, phases=3)),
                    ("new maxnreg 64", lambda: ts.topk_ascending(logits, s, e, zero, 512, maxnreg=64)),
                    ("new maxnreg 72", lambda: ts.topk_ascending(logits, s, e, zero, 512, maxnreg=72))):
        res.setdefault(name, []).append(round(bench(f, reps=7, warmup=1), 3))
for k, v in res.items():
    print(f"{k:16s} {v}")
