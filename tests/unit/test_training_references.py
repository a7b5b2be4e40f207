"""``sp_kpool.indexer_kl_loss`` against references nobody here wrote (issue #42).

1. **transformers** (``transformers.models.glm5_next``, a tiny random ``Glm5NextTextAttention``
   in float64, eager attention): the teacher is the attention's own ``attn_weights`` (head
   sum) at the ids its own ``Glm5NextTextIndexer`` selected (pools + tail; ours for both
   sides where an exact tie flips), the student the indexer's own submodules (``wq_b``,
   ``wk``, ``k_norm``, ``weights_proj``, the compress gate and ape) and
   ``get_pooled_states``. The loss and the gradients w.r.t. those seven parameters, through
   our loss, equal those of the issue's definition written directly on the transformers
   tensors with plain autograd: 1e-10 at K = 1, 1e-5 at K = 2, 4 (transformers pools in
   float32 whatever the module's dtype).
2. **Megatron-LM at K = 1** (megatron-core 0.19.2, ``scripts/reference_wheels.sh``; skipped
   without it, failing under CI): ``compute_dsa_indexer_loss`` and its hand-written
   backward ``bwd_fused_indexer_loss_naive`` (dense and sparse) against our loss and its
   ``q``, ``k``, ``head_weights`` gradients, FP32 ``1e-5``.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import sp_kpool
from sp_kpool import AttentionTeacher, ShardedSequence, TokenMass, indexer_kl_loss

from megatron_ref import dsa_indexer_loss


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny matrices, one thread


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


# --- 1. transformers' Glm5NextTextAttention / Glm5NextTextIndexer ---------------------------

HID, QLORA, HEADS, HEAD_DIM = 32, 16, 4, 8
# batch rows of transformers (one document each): real lengths and left padding
HF_LENGTHS, HF_PADS = (23, 14), (0, 9)
HF_PARAMS = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight",
             "index_kpool_compress_gate", "index_kpool_compress_ape")  # fmt: skip


def _hf_attention(kpool: int, topk: int, seed: int):
    """A float64 ``Glm5NextTextAttention`` (eager) with random weights, and its indexer."""
    glm = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next",
                              reason="needs transformers with glm5_next (the 'test' extra)")  # fmt: skip
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    cfg = Glm5NextTextConfig(
        hidden_size=HID, q_lora_rank=QLORA, kv_lora_rank=16, num_attention_heads=4, num_key_value_heads=4,
        qk_rope_head_dim=0, qk_nope_head_dim=8, v_head_dim=8, index_topk=topk, index_head_dim=HEAD_DIM,
        index_n_heads=HEADS, index_kpool=kpool, index_kpool_always_select_tail=True, num_hidden_layers=1,
        layer_types=["full_attention"], indexer_types=["full"], mlp_layer_types=["dense"],
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    attn = glm.Glm5NextTextAttention(cfg, layer_idx=0).double().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # the indexer's gate, ape and norm start as zeros / ones: randomise all
        for name, p in attn.named_parameters():
            scale = 1.0 if "norm" in name else (0.5 if "ape" in name else p.shape[-1] ** -0.5)
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * scale
                    + (1.0 if name.endswith("norm.weight") else 0.0))  # fmt: skip
    return attn


def _hf_case(kpool: int, topk: int, seed: int = 1):
    """The float64 transformers attention and the indexer's inputs (``hidden``, ``q_resid``:
    constants, as in training), our real rows (the batch rows' real tokens, concatenated)."""
    attn = _hf_attention(kpool, topk, seed)
    B, S = len(HF_LENGTHS), max(n + p for n, p in zip(HF_LENGTHS, HF_PADS))
    g = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(B, S, HID, generator=g, dtype=torch.float64)
    mask = torch.zeros(B, S, dtype=torch.bool)
    for b, (n, p) in enumerate(zip(HF_LENGTHS, HF_PADS)):
        mask[b, p : p + n] = True
    with torch.no_grad():
        q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden))
    rows = torch.cat([b * S + torch.arange(p, p + n) for b, (n, p) in enumerate(zip(HF_LENGTHS, HF_PADS))])
    return SimpleNamespace(attn=attn, idx=attn.indexer, hidden=hidden, q_resid=q_resid, mask=mask, B=B, S=S,
                           rows=rows, cu=_cu(HF_LENGTHS), kpool=kpool, topk=topk)  # fmt: skip


def _hf_run(c, ids=None):
    """One eager forward of the transformers attention (no grad): ``attn_weights [B, Hq, S,
    S]`` and the ids its mask was built from ``[B, S, width]`` (batch-row positions): its
    own indexer's, or ``ids`` in their place (our real-token ids mapped to positions)."""
    seen = []

    def hook(module, args, kwargs, out):
        if ids is not None:
            assert out.shape == ids.shape
            out = ids.to(out.dtype)
        seen.append(out)
        return out

    handle = c.idx.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            _, attn_weights, _ = c.attn(c.hidden, attention_mask=c.mask)
    finally:
        handle.remove()
    (used,) = seen
    assert attn_weights.shape == (c.B, 4, c.S, c.S) and used.shape == (c.B, c.S, c.topk + c.kpool - 1)
    return attn_weights, used.long()


def _to_positions(c, ids, width):
    """Our ids ``[N, w]`` (real-token ids) as transformers' ``[B, S, width]`` (positions)."""
    out = torch.full((c.B, c.S, width), -1, dtype=torch.long)
    for b, (n, pad) in enumerate(zip(HF_LENGTHS, HF_PADS)):
        rows = ids[c.cu[b] : c.cu[b] + n].long()
        out[b, pad : pad + n, : rows.shape[1]] = torch.where(rows >= 0, rows - c.cu[b] + pad, -1)
    return out


def _student_inputs(c, ape_shift: float = 0.0):
    """Our five inputs from the transformers indexer's own submodules (autograd to its
    parameters), as ``Glm5NextTextIndexer.forward`` builds them, on our real rows.
    ``ape_shift``: added to ape's first slot (a shift of every slot alike changes nothing)."""
    idx, B, S = c.idx, c.B, c.S
    q = idx.wq_b(c.q_resid).view(B, S, HEADS, HEAD_DIM)
    k = idx.k_norm(idx.wk(c.hidden))
    gates = F.linear(c.hidden, idx.index_kpool_compress_gate)
    w = idx.weights_proj(c.hidden)  # raw: both we and transformers scale it by H^-1/2

    def real(t):
        return t.reshape(B * S, *t.shape[2:]).index_select(0, c.rows)

    ape = idx.index_kpool_compress_ape
    return real(q), real(k), real(gates), real(w), ape + ape_shift * (torch.arange(c.kpool) == 0)[:, None]


def _hf_index_scores(c):
    """The transformers indexer's scores ``[B, S, P]``, its pools' tokens ``[B, P, K]`` and
    validity ``[B, P]``: ``get_pooled_states`` and the lines of its ``forward`` after it,
    with autograd through its submodules (its ``forward`` is ``no_grad``); without
    ``forward``'s ``.float()`` casts of the scores, so in float64."""
    idx = c.idx
    q = idx.wq_b(c.q_resid).view(c.B, c.S, HEADS, HEAD_DIM)
    k = idx.k_norm(idx.wk(c.hidden))
    gates = F.linear(c.hidden, idx.index_kpool_compress_gate)
    packed = torch.cat([k, gates, c.mask.to(k.dtype)[..., None]], dim=-1)
    pool_keys, pool_tokens, pool_valid = idx.get_pooled_states(packed_states=packed)
    scores = F.relu(torch.matmul(q, pool_keys.transpose(-1, -2).unsqueeze(1)) * idx.softmax_scale)
    weights = idx.weights_proj(c.hidden) * idx.n_heads**-0.5
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2), pool_tokens, pool_valid


def _row_pools(pool_tokens, pool_valid, b, chosen) -> list[int]:
    """The complete pools of batch row ``b`` whose ``K`` tokens are all in ``chosen``."""
    return [p for p in range(pool_tokens.shape[1])
            if bool(pool_valid[b, p]) and all(int(x) in chosen for x in pool_tokens[b, p])]  # fmt: skip


def _hf_direct_loss(c, attn_weights, hf_ids):
    """The issue's definition written on the transformers tensors alone: for each real row
    with a visible complete pool (``N`` rows), candidates = the pools of
    ``get_pooled_states`` whose ``K`` tokens are all among the row's ids ``hf_ids`` (those
    the attention ran with); pool mass = the sum of the head-summed ``attn_weights`` over
    its ``K`` tokens, renormalised over the candidates; student = ``log_softmax`` over the
    candidates of :func:`_hf_index_scores`; ``loss = sum KL / N``."""
    index_scores, pool_tokens, pool_valid = _hf_index_scores(c)
    head_sum = attn_weights.sum(dim=1)  # [B, S, S]
    total, rows, nonempty = index_scores.new_zeros(()), 0, 0
    for b, (n, pad) in enumerate(zip(HF_LENGTHS, HF_PADS)):
        for i in range(pad + c.kpool - 1, pad + n):
            rows += 1
            cand = _row_pools(pool_tokens, pool_valid, b, {int(x) for x in hf_ids[b, i] if x >= 0})
            if not cand:
                continue
            nonempty += 1
            m = torch.stack([head_sum[b, i, pool_tokens[b, p]].sum() for p in cand])
            m = m / m.sum()
            total = total + (m * (m.log() - torch.log_softmax(index_scores[b, i, cand], dim=0))).sum()
    assert nonempty > rows // 2
    return total / rows


def _tie_flips(c, ids, hf_ids) -> int:
    """Rows where our ids and transformers' own differ as sets; asserts each is a tie flip:
    the pools only one side chose all have the same score (exact ties: every head's ReLU
    zero). Returns their number."""
    with torch.no_grad():
        scores, pool_tokens, pool_valid = _hf_index_scores(c)
    flips = 0
    for b, (n, pad) in enumerate(zip(HF_LENGTHS, HF_PADS)):
        for i in range(n):
            ours = {int(x) - c.cu[b] + pad for x in ids[c.cu[b] + i] if x >= 0}
            theirs = {int(x) for x in hf_ids[b, pad + i] if x >= 0}
            if ours == theirs:
                continue
            flips += 1
            a, z = (set(_row_pools(pool_tokens, pool_valid, b, s)) for s in (ours, theirs))
            assert len(a) == len(z) and ours - theirs and all(pool_tokens[b, p].max() <= pad + i for p in a | z)
            tails = [ids_ - {x for p in pools for x in pool_tokens[b, p].tolist()}
                     for ids_, pools in ((ours, a), (theirs, z))]  # fmt: skip
            assert tails[0] == tails[1], (b, i, tails)
            tied = torch.stack([scores[b, pad + i, p] for p in a ^ z])
            assert float(tied.max() - tied.min()) <= 1e-12 * float(scores[b, pad + i].abs().max()), (b, i, tied)
    return flips


def _token_mass(c, attn_weights, ids):
    """``TokenMass``: the head-summed ``attn_weights`` of each of our ids (0 at -1), the
    row's batch row and position mapped from our real-token ids."""
    head_sum = attn_weights.sum(dim=1)
    mass = torch.zeros(ids.shape, dtype=torch.float64)
    for b, (n, pad) in enumerate(zip(HF_LENGTHS, HF_PADS)):
        for i in range(n):
            t = c.cu[b] + i
            for col, x in enumerate(ids[t].tolist()):
                if x >= 0:
                    mass[t, col] = head_sum[b, pad + i, x - c.cu[b] + pad]
    return mass


# K = 1: every pooling softmax is over one slot, exactly 1 in any precision, so the two
# sides compute in float64 throughout (the teacher's float32 softmax, see below, is the
# same tensor on both sides): 1e-10. K > 1: transformers' get_pooled_states computes the
# pooling softmax in float32 (``grouped_gate_scores.float() + ape.float()``, whatever the
# module's dtype), ours in float64: pooled keys differ by ~3e-7, the loss and gradients
# by ~2e-7 relative (observed): 1e-5.
HF_CASES = [(1, 4, 1e-10), (2, 6, 1e-5), (4, 8, 1e-5)]


@pytest.mark.parametrize("kpool, topk, tol", HF_CASES, ids=[f"K{c[0]}" for c in HF_CASES])
def test_transformers_sparse_loss_and_indexer_parameter_gradients(kpool, topk, tol):
    """Sparse stage against transformers, float64 (the eager attention's softmax runs in
    float32 and is cast back: that only rounds the teacher, an input both sides share).

    Ids: ``kpool_topk`` on the student inputs (tail ``"fixed"``). Per real row they equal
    the ids of transformers' own indexer (pools + tail) as sets, except where the two break
    an exact tie differently (pools whose every head's ReLU is 0: asserted); if any row
    flips, the attention runs again with our ids in its indexer's place (a forward hook)
    and both sides use that run: ours for both. Teacher: ``TokenMass`` = the head-summed
    ``attn_weights`` at our columns. Compared: our loss (``coeff=1``,
    ``normalize="global_rows"``, ``N = sum_d max(0, len_d - K + 1)``) with
    :func:`_hf_direct_loss`, relative ``tol``; the gradients of both w.r.t. the indexer's
    parameters (``wq_b``, ``wk``, ``k_norm`` weight and bias, ``weights_proj``, the
    compress gate and ape; ours backpropagated through the transformers submodules that
    built q, k, gates, head_weights), each within ``tol * max|g|``."""
    c = _hf_case(kpool, topk)
    seq = ShardedSequence.split(c.cu, world_size=1, rank=0)
    params = [dict(c.idx.named_parameters())[n] for n in HF_PARAMS]
    with torch.no_grad():
        ids = sp_kpool.kpool_topk(*_student_inputs(c), seq, topk=topk, kpool=kpool)
    attn_weights, hf_ids = _hf_run(c)
    flips = _tie_flips(c, ids, hf_ids)
    assert flips <= len(c.rows) // 10, flips
    if flips:
        attn_weights, hf_ids = _hf_run(c, _to_positions(c, ids, hf_ids.shape[2]))
        assert _tie_flips(c, ids, hf_ids) == 0
    mass = _token_mass(c, attn_weights, ids)
    # not vacuous: some rows select fewer tokens than they see; with K > 1 the tail holds mass
    visible = torch.cat([torch.arange(1, n + 1) for n in HF_LENGTHS])
    assert bool(((ids >= 0).sum(dim=1) < visible).any())
    if kpool > 1:
        assert float(mass[:, topk:].sum()) > 0.1

    ours = indexer_kl_loss(*_student_inputs(c), seq, teacher=TokenMass(mass), selection=ids, topk=topk, kpool=kpool)
    ours_grads = torch.autograd.grad(ours, params)
    ref = _hf_direct_loss(c, attn_weights, hf_ids)
    ref_grads = torch.autograd.grad(ref, params)
    ours, ref = ours.detach(), ref.detach()
    assert float(ref) > 1e-3
    torch.testing.assert_close(ours, ref, rtol=tol, atol=0)
    for name, a, b in zip(HF_PARAMS, ours_grads, ref_grads):
        scale = float(b.abs().max())
        assert scale > 0 or (kpool == 1 and "compress" in name), name  # one slot: the gate's softmax is 1
        torch.testing.assert_close(a, b, rtol=0, atol=tol * max(scale, 1e-300), msg=name)
    if kpool > 1:  # the comparison sees ape: a small change is far outside the tolerance
        with torch.no_grad():
            shifted = indexer_kl_loss(*_student_inputs(c, ape_shift=0.05), seq, teacher=TokenMass(mass),
                                      selection=ids, topk=topk, kpool=kpool)  # fmt: skip
        assert abs(float(shifted) - float(ref)) > 100 * tol * float(ref)


# --- 2. Megatron-LM's compute_dsa_indexer_loss at K = 1 -------------------------------------

MG_LENGTHS = [9, 6, 3, 1, 5, 12]
MG_H, MG_D, MG_HQ, MG_DQK, MG_TOPK, MG_COEFF = 3, 8, 4, 6, 4, 0.37
FP32_RTOL = 1e-5  # the FP32 tolerance; observed ~3e-7 (both sides compute in FP32)


def _megatron_case(seed=0):
    """FP32 inputs for one packed sequence (Megatron ``b = 1``, varlen bounds of its own
    ``generate_varlen_mask_params``), an MQA attention ``q_a [N, Hq, Dqk]``, ``k_a [N, Dqk]``
    and our ids (``kpool_topk``, ``K = 1``)."""
    mg = dsa_indexer_loss()
    N, cu = sum(MG_LENGTHS), _cu(MG_LENGTHS)
    g = torch.Generator().manual_seed(seed)
    x = SimpleNamespace(q=torch.randn(N, MG_H, MG_D, generator=g), k=torch.randn(N, MG_D, generator=g),
                        gates=torch.randn(N, MG_D, generator=g), w=torch.randn(N, MG_H, generator=g),
                        ape=torch.randn(1, MG_D, generator=g), q_a=torch.randn(N, MG_HQ, MG_DQK, generator=g),
                        k_a=torch.randn(N, MG_DQK, generator=g), scale=MG_DQK**-0.5, N=N, mg=mg)  # fmt: skip
    x.seq = ShardedSequence.split(cu, world_size=1, rank=0)
    x.ids = sp_kpool.kpool_topk(x.q, x.k, x.gates, x.w, x.ape, x.seq, topk=MG_TOPK, kpool=1)
    x.starts, x.ends = mg.masking.generate_varlen_mask_params(torch.tensor(cu))
    # lse of the attention that ran (float64, rounded to FP32 as an attention kernel returns it)
    pos = torch.arange(N)
    visible = (pos[None, :] >= x.starts[:, None]) & (pos[None, :] < x.ends[:, None])
    chosen = torch.zeros(N, N + 1, dtype=torch.bool)
    chosen.scatter_(1, torch.where(x.ids >= 0, x.ids.long(), N), True)
    chosen = chosen[:, :N]
    assert bool((chosen <= visible).all()) and bool((chosen.sum(1) < visible.sum(1)).any())
    logits = torch.einsum("thd,sd->ths", x.q_a.double(), x.k_a.double()) * x.scale  # [N, Hq, N]

    def lse(allowed):
        return torch.logsumexp(logits.masked_fill(~allowed[:, None, :], float("-inf")), dim=-1)

    x.lse_dense, x.lse_sparse = lse(visible), lse(chosen)
    # Megatron's sparse teacher per selected id: each head's softmax over the selected ids, summed
    p = torch.exp(logits - x.lse_sparse[..., None]).masked_fill(~chosen[:, None, :], 0).sum(dim=1)  # [N, N]
    x.mass = torch.where(x.ids >= 0, p.gather(1, x.ids.long().clamp_min(0)), 0.0)
    return x


def _megatron_loss_and_grads(x, sparse: bool):
    """Megatron's loss (``loss_coeff = MG_COEFF``) and ``bwd_fused_indexer_loss_naive``'s
    ``q``, ``k`` and ``weights`` gradients for a unit upstream gradient. Its ``weights`` are
    ours pre-scaled by ``H^-1/2 D^-1/2`` (``DSAIndexer``, dsa.py ``weights * index_n_heads**-0.5
    * softmax_scale``), so ``d/d head_weights = H^-1/2 D^-1/2 * d/d weights``."""
    mg, N = x.mg, x.N
    q, k, w = x.q[:, None], x.k[:, None], (x.w * MG_H**-0.5 * MG_D**-0.5)[:, None]  # sbhd, sbd, sbh (b = 1)
    query, key = x.q_a[:, None], x.k_a[:, None, None].expand(N, 1, MG_HQ, MG_DQK)  # MQA: one key for all heads
    topk = x.ids.long()[None]
    bounds = dict(varlen_starts=x.starts, varlen_ends=x.ends)
    index_scores = mg._compute_index_scores(q, w, k)
    loss = mg.compute_dsa_indexer_loss(index_scores, topk, query, key, x.scale, MG_COEFF, sparse, mg.pg_collection,
                                       **bounds)  # fmt: skip
    dq, dw, dk = mg.bwd_fused_indexer_loss_naive(q, w, k, query, key, topk, x.scale, MG_COEFF, sparse, None,
                                                 torch.tensor(1.0), mg.pg_collection, **bounds)  # fmt: skip
    return loss, {"q": dq[:, 0], "k": dk[:, 0], "head_weights": dw[:, 0] * MG_H**-0.5 * MG_D**-0.5}


MG_CASES = ["dense-attention", "sparse-mass", "sparse-attention"]


@pytest.mark.parametrize("case", MG_CASES)
def test_megatron_indexer_loss_at_kpool_1(case):
    """At ``K = 1`` every token is its own pool (the pooling softmax is over one slot: ape
    and gates have no effect and get zero gradients), so our loss is Megatron's, term by
    term, when the teacher is the same:

    - ``dense-attention``: ``AttentionTeacher(q_a, k_a, lse, scale)`` with the lse of the full
      causal attention of each document: ``m = sum_h softmax_h`` over the visible tokens,
      then L1-normalised = Megatron's dense target (per-head softmax over the varlen-causal
      keys, head sum, ``normalize_indexer_target``).
    - ``sparse-mass``: ``TokenMass`` = for each selected id ``sum_h`` of the head's softmax
      **renormalised over the row's selected ids** (Megatron's sparse teacher, whose
      ``index_mask`` is added to the attention logits before the per-head softmax).
    - ``sparse-attention``: ``AttentionTeacher`` with the lse of the attention that ran in the
      sparse stage, over the selected ids only: the same per-head renormalisation, so the
      same teacher. (With the full attention's lse instead the heads weigh differently,
      ``sum_h P_h`` vs ``sum_h P_h / sum_sel P_h``: not Megatron's definition; asserted to
      differ.)

    Ids: ours (``kpool_topk``), given to Megatron as ``topk_indices`` ([1, N, topk], -1
    unused). Normalisation: Megatron ``sum KL / (b * sq) * loss_coeff`` (``query_valid_rows``
    None); ours ``coeff / N`` with ``N = sum_d max(0, len_d - K + 1) = b * sq`` at ``K = 1``
    (every real row has a visible pool): ``coeff = loss_coeff = 0.37``, ``normalize=
    "global_rows"``. FP32 on both sides: loss ``rtol 1e-5``; ``q``, ``k``, ``head_weights``
    gradients within ``1e-5 * max|g|`` of Megatron's hand-written backward."""
    x = _megatron_case()
    stage, kind = case.split("-")
    sparse = stage == "sparse"
    if kind == "mass":
        teacher = TokenMass(x.mass)
    else:
        teacher = AttentionTeacher(x.q_a, x.k_a, (x.lse_sparse if sparse else x.lse_dense).float(), x.scale)
    leaves = [t.clone().requires_grad_() for t in (x.q, x.k, x.gates, x.w, x.ape)]
    ours = indexer_kl_loss(*leaves, x.seq, teacher=teacher, selection=x.ids if sparse else "dense", topk=MG_TOPK,
                           kpool=1, coeff=MG_COEFF)  # fmt: skip
    grads = dict(zip(("q", "k", "gates", "head_weights", "ape"), torch.autograd.grad(ours, leaves)))
    ref, ref_grads = _megatron_loss_and_grads(x, sparse)
    assert ours.dtype == ref.dtype == torch.float32 and float(ref) > 1e-3
    torch.testing.assert_close(ours.detach(), ref, rtol=FP32_RTOL, atol=0)
    for name, b in ref_grads.items():
        scale = float(b.abs().max())
        assert scale > 0, name
        torch.testing.assert_close(grads[name], b, rtol=0, atol=FP32_RTOL * scale, msg=name)
    assert bool((grads["gates"] == 0).all()) and bool((grads["ape"] == 0).all())
    if sparse:  # the head weighting matters: the full attention's lse is another teacher
        other = AttentionTeacher(x.q_a, x.k_a, x.lse_dense.float(), x.scale)
        off = indexer_kl_loss(x.q, x.k, x.gates, x.w, x.ape, x.seq, teacher=other, selection=x.ids, topk=MG_TOPK,
                              kpool=1, coeff=MG_COEFF)  # fmt: skip
        assert abs(float(off) - float(ref)) > 100 * FP32_RTOL * float(ref)
