"""Where the searches' answers sit in their brackets on the DeepGEMM logits of the H slice
(value space): phase 2's L (the 512th largest maximum of groups of 8) in [min, max] of the
visible group maxima, phase 4's T (the 512th largest score) in [L, max]; then the selector
with first-step split fractions (split2, split4) timed on those logits, each checked equal
to the committed selector (ts_old)."""
import json, os, sys, time
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
    del q8, wq, k8, ks
    R, W = logits.shape
    r2, r4, nl = [], [], []
    for i in range(0, R, 1024):
        blk = logits[i : i + 1024]
        gm = blk.view(blk.shape[0], W // 8, 8).amax(2)
        vis = gm > -float("inf")
        L = gm.topk(512, dim=1).values[:, -1]
        T = blk.topk(512, dim=1).values[:, -1]
        mx = gm.amax(1)
        mn = torch.where(vis, gm, float("inf")).amin(1)
        r2.append((L - mn) / (mx - mn)); r4.append((T - L) / (mx - L)); nl.append((blk >= L[:, None]).sum(1).float())
    r2, r4, nl = torch.cat(r2), torch.cat(r4), torch.cat(nl)
    q = torch.tensor([0.0, 0.01, 0.05, 0.1, 0.5, 0.9, 0.95, 0.99, 1.0], device="cuda")
    res[f"H{H} rel L in [min,max]"] = [round(v, 4) for v in torch.quantile(r2, q).tolist()]
    res[f"H{H} rel T in [L,max]"] = [round(v, 5) for v in torch.quantile(r4, q).tolist()]
    res[f"H{H} cells >= L"] = [round(v) for v in torch.quantile(nl, q).tolist()]
    print({k: v for k, v in res.items() if k.startswith(f"H{H}")}, flush=True)
    d4 = (round(torch.quantile(r4, 0.05).item() * 0.8, 4), round(torch.quantile(r4, 0.95).item() * 1.1, 4))
    d2 = (round(torch.quantile(r2, 0.05).item(), 3), round(torch.quantile(r2, 0.95).item(), 3))
    zero = torch.zeros(R, dtype=torch.int64, device="cuda")
    ref = ts_old.topk_ascending(logits, s, e, zero, 512)
    cfgs = {"cur": {}, "s2": dict(split2=(0.45, 0.6)), "s4a": dict(split4=(0.005, 0.02)), "s4b": dict(split4=(0.01, 0.03)),
            "s4c": dict(split4=(0.002, 0.012)), "s2+s4a": dict(split2=(0.45, 0.6), split4=(0.005, 0.02)),
            "data": dict(split2=d2, split4=d4)}
    for name, kw in cfgs.items():
        got = ts.topk_ascending(logits, s, e, zero, 512, **kw)
        print(f"H={H} {name} {kw} equal={torch.equal(got, ref)}", flush=True)
    for rep in range(3):
        for name, kw in cfgs.items():
            ms = bench(lambda: ts.topk_ascending(logits, s, e, zero, 512, **kw), reps=7, warmup=1)
            res.setdefault(f"H{H} select {name} {kw}", []).append(round(ms, 3))
    for key in res:
        if key.startswith(f"H{H} select"):
            print(key, res[key], flush=True)
    del logits, ref; torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "fr.json"), "w"), indent=1)
