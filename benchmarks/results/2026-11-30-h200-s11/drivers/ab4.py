"""Phase 1 without layout conversions (the working tree) against dc151bb (ts_prev) and
aa9c4b7 (ts_old): the selector alone and its phase 1 on the DeepGEMM logits of the H slice,
then the whole FP8 indexer with each, interleaved in alternating order; DeepGEMM alone."""
import json, os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import torch
from bench_kernels import bench, bench_host_ahead, bench_do_bench
from sp_kpool.backends import BACKENDS
from sp_kpool.kernels import triton_select as ts
sys.path.insert(0, os.path.join(os.getcwd(), "gpu11"))
import ts_old, ts_prev
from sp_kpool.testing.problems import reference_slice_problem
from sp_kpool.backends.deepgemm_backend import mqa_api
from sp_kpool.kernels.triton_serving import pools_serving, queries_fp8
from sp_kpool.pooling import pool_table
from sp_kpool.selection import row_meta
MODS = {"old": ts_old.topk_ascending, "prev": ts_prev.topk_ascending, "new": ts.topk_ascending}
res = {}
be = BACKENDS["deepgemm"]
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
    ref = ts_old.topk_ascending(logits, s, e, zero, 512)
    for n, f in MODS.items():
        print(f"H={H} {n} equal={torch.equal(f(logits, s, e, zero, 512), ref)}", flush=True)
    for rep in range(3):
        time.sleep(0.5)
        for n, f in (MODS.items() if rep % 2 == 0 else list(MODS.items())[::-1]):
            res.setdefault(f"H{H} select {n}", []).append(round(bench(lambda: f(logits, s, e, zero, 512), reps=7, warmup=1), 3))
            res.setdefault(f"H{H} phase 1 {n}", []).append(round(bench(lambda: f(logits, s, e, zero, 512, phases=1), reps=7, warmup=1), 3))
    for key in res:
        if key.startswith(f"H{H} "):
            print(key, res[key], flush=True)
    del logits, ref; torch.cuda.empty_cache()
    if H != 32:
        continue
    new_fn = ts.topk_ascending
    arms = ["old", "new"]
    def use(arm):
        ts.topk_ascending = ts_old.topk_ascending if arm == "old" else new_fn
    outs = {}
    for arm in arms:
        use(arm)
        outs[arm] = be.run(p).clone()
    print(f"H={H} whole outputs equal: {torch.equal(outs['old'], outs['new'])}", flush=True)
    del outs
    for rep in range(4):
        for arm in (arms if rep % 2 == 0 else arms[::-1]):
            time.sleep(1.0)
            use(arm)
            ms = bench(lambda: be.run(p), reps=7, warmup=1)
            ahead, host = bench_host_ahead(lambda: be.run(p), reps=5)
            db = bench_do_bench(lambda: be.run(p))
            res.setdefault(f"H{H} whole {arm} (cold, ahead, do_bench)", []).append((round(ms, 3), round(ahead, 3), round(db, 3)))
        time.sleep(1.0)
        a = bench_do_bench(lambda: fn(q8, (k8, ks), wq, s, e, clean_logits=True))
        b = bench_do_bench(lambda: fn(q8, (k8, ks), wq, s, e, clean_logits=False))
        res.setdefault(f"H{H} dg alone do_bench clean/noclean", []).append((round(a, 3), round(b, 3)))
    ts.topk_ascending = new_fn
    for key in res:
        if key.startswith(f"H{H} whole") or key.startswith(f"H{H} dg"):
            print(key, res[key], flush=True)
    del p, k8, q8, wq; torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "ab4.json"), "w"), indent=1)
