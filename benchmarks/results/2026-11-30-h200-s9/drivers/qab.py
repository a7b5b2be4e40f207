"""queries_fp8: the committed kernel (gpu9/old) against the working tree's, on the H 32/64
slice queries, without and with the zero rows the driver asks for (rank 3: 768 before,
15232 after); outputs compared."""
import os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "scripts")); sys.path.insert(0, os.path.join(os.getcwd(), "gpu9/old"))
import torch
from bench_kernels import bench
from sp_kpool.kernels.triton_serving import queries_fp8 as new
from sp_kpool_old.kernels.triton_serving import queries_fp8 as old
from sp_kpool.testing.problems import reference_slice_problem
for H in (32, 64):
    p = reference_slice_problem(H, "fp8", total=131072, seed=H)
    a8, aw = old(p.q, p.head_weights)
    b8, bw = new(p.q, p.head_weights)
    c8, cw = new(p.q, p.head_weights, before=768, after=15232)
    S = p.q.shape[0]
    eq = torch.equal(a8.view(torch.uint8), b8.view(torch.uint8)) and torch.equal(aw, bw)
    eqp = (torch.equal(c8[768:768 + S].view(torch.uint8), a8.view(torch.uint8)) and torch.equal(cw[768:768 + S], aw)
           and int(c8[:768].view(torch.uint8).max()) == 0 and int(c8[768 + S:].view(torch.uint8).max()) == 0
           and int(cw[:768].abs().max()) == 0 and int(cw[768 + S:].abs().max()) == 0)
    print(f"H={H} new==old {eq} padded==old+zeros {eqp}", flush=True)
    for rep in range(3):
        t_old = bench(lambda: old(p.q, p.head_weights), reps=20)
        t_new = bench(lambda: new(p.q, p.head_weights), reps=20)
        t_pad = bench(lambda: new(p.q, p.head_weights, before=768, after=15232), reps=20)
        print(f"H={H} rep{rep} old {t_old*1e3:.1f} us new {t_new*1e3:.1f} us new+pad {t_pad*1e3:.1f} us", flush=True)
    del p, a8, aw, b8, bw, c8, cw; torch.cuda.empty_cache()
