"""Whole FP8 call (deepgemm backend) with the driver's table cache on (a call after one with
the same sequence) and off (every call builds its tables), interleaved in one process, plus
DeepGEMM alone; also the host timeline of the first DeepGEMM launch."""
import json, os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import torch
from bench_kernels import bench, bench_host_ahead
from sp_kpool.backends import BACKENDS
from sp_kpool.testing.problems import reference_slice_problem
import deep_gemm
from sp_kpool.backends import deepgemm_backend as DGB
be = BACKENDS["deepgemm"]
first_launch = []
orig = deep_gemm.fp8_mqa_logits
def wrapped(*a, **k):
    first_launch.append(time.perf_counter())
    return orig(*a, **k)
res = {}
for H in [int(h) for h in (sys.argv[1] if len(sys.argv) > 1 else "32").split(",")]:
    p = reference_slice_problem(H, "fp8", total=131072, seed=H)
    ref = be.run(p).clone()
    for rep in range(3):
        for mode in ("1", "0"):
            os.environ["SP_KPOOL_TABLE_CACHE"] = mode
            assert torch.equal(be.run(p), ref)
            ms = bench(lambda: be.run(p), reps=7, warmup=1)
            ahead, host = bench_host_ahead(lambda: be.run(p), reps=5)
            # host time to the first DeepGEMM launch, device busy
            deep_gemm.fp8_mqa_logits = wrapped; DGB.mqa_api.cache_clear(); first_launch.clear()
            torch.cuda._sleep(40_000_000); t0 = time.perf_counter(); be.run(p); t1 = time.perf_counter()
            deep_gemm.fp8_mqa_logits = orig; DGB.mqa_api.cache_clear(); torch.cuda.synchronize()
            to_dg = 1e3 * (first_launch[0] - t0)
            res.setdefault(f"H{H} cache={mode}", []).append(dict(whole=ms, host_ahead=ahead, host_call=host, host_to_first_deepgemm=to_dg, host_whole=1e3 * (t1 - t0)))
            print(f"H={H} cache={mode} rep{rep} whole {ms:.3f} ms host-ahead {ahead:.3f} ms host call {host:.3f} ms host to 1st DeepGEMM {to_dg:.3f} ms", flush=True)
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
        res.setdefault(f"H{H} dg", []).append(dict(clean=a, noclean=b))
        print(f"H={H} deepgemm alone clean {a:.3f} ms noclean {b:.3f} ms", flush=True)
    del p, k8, q8, wq; torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "whole_cache.json"), "w"), indent=1)
