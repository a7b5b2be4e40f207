"""Can the selector run beside DeepGEMM? The H 32 slice split in two halves of rows: DeepGEMM
on half B on one stream while the selector reads half A's logits on another, against the
two one after the other (CUDA events; both outputs checked)."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
import torch
from sp_kpool.kernels import triton_select as ts
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
R = q8.shape[0]; h = R // 2
A, B = slice(0, h), slice(h, R)
LA = fn(q8[A], (k8, ks), wq[A], s[A], e[A], clean_logits=False)[:, : k8.shape[0]]
zero = torch.zeros(h, dtype=torch.int64, device="cuda")
ref_sel = ts.topk_ascending(LA, s[A], e[A], zero, 512)
sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
def dg():
    return fn(q8[B], (k8, ks), wq[B], s[B], e[B], clean_logits=False)
def sel():
    return ts.topk_ascending(LA, s[A], e[A], zero, 512)
def timed(f, n=5):
    out = []
    for _ in range(n):
        torch.cuda.synchronize(); torch.cuda._sleep(5_000_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); f(); b.record(); b.synchronize(); out.append(round(a.elapsed_time(b), 3))
    return out
def serial():
    dg(); sel()
def both():
    cur = torch.cuda.current_stream()
    ev = torch.cuda.Event(); ev.record(cur)
    sa.wait_event(ev); sb.wait_event(ev)
    with torch.cuda.stream(sa):
        dg()
    with torch.cuda.stream(sb):
        r = sel()
    cur.wait_stream(sa); cur.wait_stream(sb)
    return r
def both_sel_first():
    cur = torch.cuda.current_stream()
    ev = torch.cuda.Event(); ev.record(cur)
    sa.wait_event(ev); sb.wait_event(ev)
    with torch.cuda.stream(sb):
        r = sel()
    with torch.cuda.stream(sa):
        dg()
    cur.wait_stream(sa); cur.wait_stream(sb)
    return r
print("concurrent selector equal:", torch.equal(both(), ref_sel))
for rep in range(2):
    print("dg half B", timed(dg), "selector half A", timed(sel))
    print("serial", timed(serial), "concurrent (dg first)", timed(both), "concurrent (selector first)", timed(both_sel_first), flush=True)
