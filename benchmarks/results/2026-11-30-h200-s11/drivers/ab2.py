"""The new selector (HEAD + phase-1 loop without branches + two reductions less) against the
committed one (ts_old): launch variants on the DeepGEMM logits of the H slice, then the
whole FP8 indexer with each, interleaved; DeepGEMM alone by do_bench. argv: H list,
variant list (name=dict(...);...)."""
import ast, json, os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import torch
from bench_kernels import bench, bench_host_ahead, bench_do_bench
from sp_kpool.backends import BACKENDS
from sp_kpool.kernels import triton_select as ts
sys.path.insert(0, os.path.join(os.getcwd(), "gpu11"))
import ts_old
from sp_kpool.testing.problems import reference_slice_problem
from sp_kpool.backends.deepgemm_backend import mqa_api
from sp_kpool.kernels.triton_serving import pools_serving, queries_fp8
from sp_kpool.pooling import pool_table
from sp_kpool.selection import row_meta
VARIANTS = {"new": {}}
for item in (sys.argv[2].split(";") if len(sys.argv) > 2 and sys.argv[2] else []):
    name, kw = item.split("=", 1)
    node = ast.parse(kw, mode="eval").body
    VARIANTS[name] = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
WHOLE_REPS = int(os.environ.get("WHOLE_REPS", "3"))
res = {}
be = BACKENDS["deepgemm"]
new_fn = ts.topk_ascending
t_start = time.time()
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
    for name, kw in VARIANTS.items():
        got = ts.topk_ascending(logits, s, e, zero, 512, **kw)
        print(f"H={H} {name} {kw} equal={torch.equal(got, ref)} launch={ts.last_launch}", flush=True)
    for rep in range(3):
        time.sleep(0.5)
        ms = bench(lambda: ts_old.topk_ascending(logits, s, e, zero, 512), reps=7, warmup=1)
        res.setdefault(f"H{H} select old", []).append(round(ms, 3))
        for name, kw in VARIANTS.items():
            ms = bench(lambda: ts.topk_ascending(logits, s, e, zero, 512, **kw), reps=7, warmup=1)
            res.setdefault(f"H{H} select {name}", []).append(round(ms, 3))
    print({k: v for k, v in res.items() if k.startswith(f"H{H} select")}, flush=True)
    del logits, ref; torch.cuda.empty_cache()
    arms = ["old", "new"]
    def use(arm):
        ts.topk_ascending = ts_old.topk_ascending if arm == "old" else new_fn
    outs = {}
    for arm in arms:
        use(arm)
        outs[arm] = be.run(p).clone()
    print(f"H={H} whole outputs equal: {torch.equal(outs['old'], outs['new'])}", flush=True)
    del outs
    for rep in range(WHOLE_REPS):
        for arm in (arms if rep % 2 == 0 else arms[::-1]):  # alternate the order (clocks drift under load)
            time.sleep(1.0)
            use(arm)
            ms = bench(lambda: be.run(p), reps=7, warmup=1)
            ahead, host = bench_host_ahead(lambda: be.run(p), reps=5)
            db = bench_do_bench(lambda: be.run(p))
            res.setdefault(f"H{H} whole {arm} (cold, ahead, do_bench)", []).append((round(ms, 3), round(ahead, 3), round(db, 3)))
            print(f"H={H} {arm} rep{rep} whole {ms:.3f} ahead {ahead:.3f} do_bench {db:.3f} ms", flush=True)
        time.sleep(1.0)
        a = bench_do_bench(lambda: fn(q8, (k8, ks), wq, s, e, clean_logits=True))
        b = bench_do_bench(lambda: fn(q8, (k8, ks), wq, s, e, clean_logits=False))
        res.setdefault(f"H{H} dg alone do_bench clean/noclean", []).append((round(a, 3), round(b, 3)))
        print(f"H={H} deepgemm alone do_bench clean {a:.3f} noclean {b:.3f} ms", flush=True)
    ts.topk_ascending = new_fn
    del p, k8, q8, wq; torch.cuda.empty_cache()
    print(f"elapsed {time.time() - t_start:.0f} s", flush=True)
for key in sorted(res):
    print(key, res[key])
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "ab.json"), "w"), indent=1)
