"""Selector L2 prefetch (topk_ascending(prefetch=)): the selector alone on the DeepGEMM
logits of the whole H slice, and the whole FP8 indexer with the library default set to
each value, interleaved in one process; DeepGEMM alone on the same inputs."""
import json, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import torch
from bench_kernels import bench, bench_host_ahead
from sp_kpool.backends import BACKENDS
from sp_kpool.kernels import triton_select as ts
from sp_kpool.testing.problems import reference_slice_problem
from sp_kpool.backends.deepgemm_backend import mqa_api
from sp_kpool.kernels.triton_serving import pools_serving, queries_fp8
from sp_kpool.pooling import pool_table
from sp_kpool.selection import row_meta
PFS = [int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "0,8192,16384,32768").split(",")]
res = {"L2": torch.cuda.get_device_properties(0).L2_cache_size}
print(res, flush=True)
be = BACKENDS["deepgemm"]
for H in [int(h) for h in (sys.argv[1] if len(sys.argv) > 1 else "32").split(",")]:
    p = reference_slice_problem(H, "fp8", total=131072, seed=H)
    fn, _ = mqa_api()
    stt, offs = pool_table(p.seq.real_cu_seq_lens, 4)
    k8, ks = pools_serving(p.k, p.gates, p.ape, stt.cuda(), fp8=True)
    q8, wq = queries_fp8(p.q, p.head_weights)
    m = row_meta(torch.arange(p.seq.shard_start, p.seq.shard_end), p.seq.real_cu_seq_lens, offs, 4)
    s, e = m.pool_lo.int().cuda(), m.pool_hi.int().cuda()
    logits = fn(q8, (k8, ks), wq, s, e, clean_logits=True)[:, : k8.shape[0]]
    zero = torch.zeros(logits.shape[0], dtype=torch.int64, device="cuda")
    ref = ts.topk_ascending(logits, s, e, zero, 512, prefetch=0)
    for pf in PFS:
        got = ts.topk_ascending(logits, s, e, zero, 512, prefetch=pf)
        print(f"H={H} selector prefetch={pf} equal={torch.equal(got, ref)} launch={ts.last_launch}", flush=True)
    for rep in range(3):
        for pf in PFS:
            ms = bench(lambda: ts.topk_ascending(logits, s, e, zero, 512, prefetch=pf), reps=7, warmup=1)
            res.setdefault(f"H{H} select pf{pf}", []).append(ms)
            print(f"H={H} selector prefetch={pf} rep{rep} {ms:.3f} ms", flush=True)
    del logits, ref; torch.cuda.empty_cache()
    outs = {}
    for pf in PFS:
        ts._DEFAULT_PREFETCH = pf
        outs[pf] = be.run(p).clone()
    print(f"H={H} whole outputs equal across prefetch: {all(torch.equal(outs[PFS[0]], o) for o in outs.values())}", flush=True)
    del outs
    for rep in range(3):
        for pf in PFS:
            ts._DEFAULT_PREFETCH = pf
            ms = bench(lambda: be.run(p), reps=7, warmup=1)
            ahead, host = bench_host_ahead(lambda: be.run(p), reps=5)
            res.setdefault(f"H{H} whole pf{pf}", []).append((ms, ahead, host))
            print(f"H={H} prefetch={pf} rep{rep} whole {ms:.3f} ms host-ahead {ahead:.3f} ms host {host:.3f} ms", flush=True)
    for rep in range(2):
        a = bench(lambda: fn(q8, (k8, ks), wq, s, e, clean_logits=True), reps=10)
        b = bench(lambda: fn(q8, (k8, ks), wq, s, e, clean_logits=False), reps=10)
        res.setdefault(f"H{H} dg_clean", []).append(a); res.setdefault(f"H{H} dg_noclean", []).append(b)
        print(f"H={H} deepgemm alone clean {a:.3f} ms noclean {b:.3f} ms", flush=True)
    del p, k8, q8, wq; torch.cuda.empty_cache()
for key in sorted(res):
    print(key, res[key])
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "wholepf.json"), "w"), indent=1)
