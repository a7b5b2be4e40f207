"""Three calls of the selector on the DeepGEMM logits of the H 32 slice (for Nsight Compute)."""
import os, sys
sys.path.insert(0, os.getcwd())
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
logits = fn(q8, (k8, ks), wq, s, e, clean_logits=True)[:, : k8.shape[0]]
zero = torch.zeros(logits.shape[0], dtype=torch.int64, device="cuda")
for _ in range(3):
    ts.topk_ascending(logits, s, e, zero, 512)
torch.cuda.synchronize()
