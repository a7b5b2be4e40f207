"""On CUDA: the indexer's KL loss (``docs/contract.md`` section 13) and ``kpool_topk(rows=)``.

* The loss and its five gradients on CUDA (FP32 inputs, sparse and dense, ``ordered`` and
  ``exact``) equal the CPU's float64 path within FP32 rounding, and two calls are bitwise
  equal (the sparse stage's partial sums of the pooled keys' gradient use int64 fixed point
  on CUDA, whose atomics are order-free).
* ``rows=`` on the GPU backends that score row subsets (``triton`` BF16, ``deepgemm`` FP8:
  :func:`sp_kpool.plan.plan_rows`) and on the torch backend on CUDA (whole chunks): the rows
  asked for are bit for bit the full call's, the others ``-1``.
"""

from __future__ import annotations

import pytest
import torch

import sp_kpool
from sp_kpool import AttentionTeacher, ShardedSequence, TokenMass, indexer_kl_loss
from sp_kpool.testing.problems import layout_seqs, make_inputs, shard_inputs
from sp_kpool.testing.training_checks import NAMES, training_case

pytestmark = pytest.mark.xdist_group("gpu")

LENGTHS = [300, 170, 1, 41]
K, TOPK = 4, 32


def _loss(x, teacher, seq, device, dtype, selection, determinism):
    leaves = [t.to(device, dtype).clone().requires_grad_() for t in (x.q, x.k, x.gates, x.head_weights, x.ape)]
    qt, kt, lse = (t.to(device) for t in teacher)
    if selection == "sparse":
        ids = sp_kpool.kpool_topk(*(t.detach().float() for t in leaves), seq, topk=TOPK, kpool=K)
        g = torch.Generator().manual_seed(5)
        mass = torch.rand(ids.shape, generator=g, dtype=torch.float64).to(device) * (ids >= 0)
        t = TokenMass(mass.to(dtype))
    else:
        ids, t = "dense", AttentionTeacher(qt.to(dtype), kt.to(dtype), lse.float(), 0.5)
    loss = indexer_kl_loss(*leaves, seq, teacher=t, selection=ids, topk=TOPK, kpool=K, determinism=determinism)
    return loss.detach(), [g.detach() for g in torch.autograd.grad(loss, leaves)], ids


@pytest.mark.parametrize("selection", ["sparse", "dense"])
@pytest.mark.parametrize("determinism", ["ordered", "exact"])
def test_kl_loss_on_cuda(selection, determinism):
    x, teacher = training_case(LENGTHS, kpool=K, heads=8, head_dim=32, seed=1, dtype=torch.float64)
    seq = layout_seqs(x.cu_seq_lens, 1)[0]
    dev = torch.device("cuda")
    loss, grads, ids = _loss(x, teacher, seq, dev, torch.float32, selection, determinism)
    again, grads2, _ = _loss(x, teacher, seq, dev, torch.float32, selection, determinism)
    assert torch.equal(loss, again) and all(torch.equal(a, b) for a, b in zip(grads, grads2)), "two calls differ"
    if selection == "sparse":  # the float64 reference on the CPU, with the CUDA call's ids
        ref_ids = ids.cpu()
        leaves = [t.clone().requires_grad_() for t in (x.q, x.k, x.gates, x.head_weights, x.ape)]
        g = torch.Generator().manual_seed(5)
        mass = torch.rand(ref_ids.shape, generator=g, dtype=torch.float64) * (ref_ids >= 0)
        ref = indexer_kl_loss(*leaves, seq, teacher=TokenMass(mass), selection=ref_ids, topk=TOPK, kpool=K)
    else:
        leaves = [t.clone().requires_grad_() for t in (x.q, x.k, x.gates, x.head_weights, x.ape)]
        ref = indexer_kl_loss(*leaves, seq, teacher=AttentionTeacher(*teacher, 0.5), selection="dense", topk=TOPK,
                              kpool=K)  # fmt: skip
    ref_grads = torch.autograd.grad(ref, leaves)
    assert float(ref.detach()) > 0
    torch.testing.assert_close(loss.cpu().double(), ref.detach(), rtol=1e-4, atol=0)
    for name, a, b in zip(NAMES, grads, ref_grads):
        scale = float(b.abs().max())
        assert scale > 0, name
        torch.testing.assert_close(a.cpu().double(), b, rtol=0, atol=1e-4 * scale, msg=name)


@pytest.mark.parametrize("backend, precision", [
    pytest.param("triton", "bf16", marks=pytest.mark.requires("triton")),
    pytest.param("deepgemm", "fp8", marks=pytest.mark.requires("deep_gemm")),
    ("torch", "bf16"),
])  # fmt: skip
def test_rows_equal_the_full_call_on_cuda(backend, precision):
    lengths = [3000, 1, 517, 4100]
    x = make_inputs(lengths, heads=32, head_dim=128, kpool=K, seed=2, dtype=torch.bfloat16)
    seq = ShardedSequence.split(x.cu_seq_lens, 1, 0)
    inp = {k: v.cuda() for k, v in shard_inputs(x, seq).items()}
    opts = dict(topk=512, kpool=K, precision=precision, backend=backend)
    full = sp_kpool.kpool_topk(**inp, seq=seq, **opts)
    g = torch.Generator().manual_seed(7)
    for mask in (torch.rand(seq.shard_size, generator=g) < 0.06, torch.arange(seq.shard_size) % 16 == 15):
        stats = {}
        got = sp_kpool.kpool_topk(**inp, seq=seq, rows=mask.cuda(), stats=stats, **opts)
        m = mask.cuda()
        assert torch.equal(got[m], full[m]), (backend, int((got[m] != full[m]).any(1).sum()))
        assert bool((got[~m] == -1).all())
        assert stats["rows"] == int(mask.sum())
