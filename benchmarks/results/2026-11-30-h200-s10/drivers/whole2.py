"""Whole FP8 indexer (deepgemm backend): the committed package (gpu10/old/sp_kpool_old =
`git archive HEAD sp_kpool`) against the working tree's, interleaved in one process, and
DeepGEMM alone on the same inputs (as bench_kernels)."""
import json, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts")); sys.path.insert(0, os.path.join(os.getcwd(), "gpu10/old"))
import torch
from bench_kernels import bench, bench_host_ahead
from sp_kpool.backends import BACKENDS as NEW
from sp_kpool_old.backends import BACKENDS as OLD
from sp_kpool.testing.problems import reference_slice_problem
res = {}
arms = (("old", OLD["deepgemm"]), ("new", NEW["deepgemm"]))
for H in [int(h) for h in (sys.argv[1] if len(sys.argv) > 1 else "32").split(",")]:
    p = reference_slice_problem(H, "fp8", total=131072, seed=H)
    outs = {name: be.run(p).clone() for name, be in arms}
    print(f"H={H} outputs equal: {torch.equal(outs['old'], outs['new'])}", flush=True)
    del outs
    for rep in range(3):
        for name, be in arms:
            ms = bench(lambda: be.run(p), reps=7, warmup=1)
            ahead, host = bench_host_ahead(lambda: be.run(p), reps=5)
            res.setdefault(f"H{H} {name}", []).append((ms, ahead, host))
            print(f"H={H} {name} rep{rep} whole {ms:.3f} ms host-ahead {ahead:.3f} ms host {host:.3f} ms", flush=True)
    from sp_kpool.backends.deepgemm_backend import mqa_api
    from sp_kpool.kernels.triton_serving import pools_serving, queries_fp8
    from sp_kpool.pooling import pool_table
    from sp_kpool.selection import row_meta
    fn, _ = mqa_api()
    stt, offs = pool_table(p.seq.real_cu_seq_lens, 4)
    k8, ks = pools_serving(p.k, p.gates, p.ape, stt.cuda(), fp8=True)
    q8, wq = queries_fp8(p.q, p.head_weights)
    m = row_meta(torch.arange(p.seq.shard_start, p.seq.shard_end), p.seq.real_cu_seq_lens, offs, 4)
    s, e = m.pool_lo.int().cuda(), m.pool_hi.int().cuda()
    for rep in range(2):
        a = bench(lambda: fn(q8, (k8, ks), wq, s, e, clean_logits=True), reps=10)
        b = bench(lambda: fn(q8, (k8, ks), wq, s, e, clean_logits=False), reps=10)
        res.setdefault(f"H{H} dg_clean", []).append(a); res.setdefault(f"H{H} dg_noclean", []).append(b)
        print(f"H={H} deepgemm alone clean {a:.3f} ms noclean {b:.3f} ms", flush=True)
    del p, k8, q8, wq; torch.cuda.empty_cache()
for key in sorted(res):
    print(key, res[key])
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "whole2.json"), "w"), indent=1)
