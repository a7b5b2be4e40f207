"""The indexer's KL loss (sp_kpool.indexer_kl_loss): float64 gradcheck, an independent naive
reference, world-size-1 equality of the loss and every gradient on gloo ranks in every
layout and gather mode (ordered: within the stated tolerance; exact: bit for bit), and
errors that name the argument on every rank."""

import pytest
import torch

import sp_kpool
from sp_kpool import AttentionTeacher, TokenMass, indexer_kl_loss
from sp_kpool.testing.dist import run_ranks
from sp_kpool.testing.kl_reference import kl_loss_reference
from sp_kpool.testing.problems import layout_seqs
from sp_kpool.testing.training_checks import NAMES, compare_with_world1, training_case

LENGTHS = [9, 6, 3, 1, 5]


def _ids(x, seq, topk):
    K = x.ape.shape[0]
    return sp_kpool.kpool_topk(x.q.float(), x.k.float(), x.gates.float(), x.head_weights.float(), x.ape.float(), seq,
                               topk=topk, kpool=K)  # fmt: skip


def _leaves(x):
    return [t.clone().requires_grad_() for t in (x.q, x.k, x.gates, x.head_weights, x.ape)]


def _teachers(x, teacher, ids, seed=3):
    qt, kt, lse = teacher
    g = torch.Generator().manual_seed(seed)
    mass = torch.rand(ids.shape, generator=g, dtype=torch.float64) * (ids >= 0)
    return {"mass": (TokenMass(mass), dict(token_mass=mass)),
            "attention": (AttentionTeacher(qt, kt, lse, 0.5), dict(attention=(qt, kt, lse, 0.5)))}  # fmt: skip


@pytest.mark.parametrize("kpool", [1, 2, 4])
@pytest.mark.parametrize("stage", ["sparse-mass", "sparse-attention", "dense-attention"])
def test_gradcheck_and_reference(kpool, stage):
    """float64: gradcheck w.r.t. all five inputs, and the loss and gradients equal a naive
    autograd transcription of the definition (one row at a time, no shared code)."""
    x, teacher = training_case(LENGTHS, kpool=kpool, heads=3, head_dim=4, seed=kpool)
    seq = layout_seqs(x.cu_seq_lens, 1)[0]
    topk = 2 * kpool
    ids = _ids(x, seq, topk)
    sparse, kind = stage.split("-")
    t, ref_kw = _teachers(x, teacher, ids)[kind]
    selection = ids if sparse == "sparse" else "dense"

    def loss(*leaves):
        return indexer_kl_loss(*leaves, seq, teacher=t, selection=selection, topk=topk, kpool=kpool)

    assert torch.autograd.gradcheck(loss, _leaves(x), fast_mode=True)  # J v for random v: the reference checks J whole
    leaves, ref_leaves = _leaves(x), _leaves(x)
    ours = loss(*leaves)
    ref = kl_loss_reference(*ref_leaves, x.cu_seq_lens, selection=ids.long() if sparse == "sparse" else None, **ref_kw)
    assert float(ref.detach()) > 0
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=0)
    for name, a, b in zip(NAMES, torch.autograd.grad(ours, leaves), torch.autograd.grad(ref, ref_leaves)):
        assert float(b.abs().max()) > 0 or (name in ("gates", "ape") and kpool == 1), name  # one slot: softmax 1
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12 * float(b.abs().max()), msg=name)


def test_fp32_and_bf16_inputs():
    """FP32 inputs compute in FP32: the loss and gradients within FP32 rounding of the float64
    call's. BF16 inputs follow the bf16 model arithmetic (pools in BF16, scores in FP32) and
    return BF16 gradients: those of autograd through the naive reference in the same
    arithmetic."""
    x, teacher = training_case(LENGTHS, kpool=2, heads=4, head_dim=8, seed=5)
    seq = layout_seqs(x.cu_seq_lens, 1)[0]
    ids = _ids(x, seq, 4)
    t, ref_kw = _teachers(x, teacher, ids)["mass"]
    ref_leaves = _leaves(x)
    ref = indexer_kl_loss(*ref_leaves, seq, teacher=t, selection=ids, topk=4, kpool=2)
    ref_grads = torch.autograd.grad(ref, ref_leaves)
    leaves = [v.detach().float().requires_grad_() for v in ref_leaves]
    loss = indexer_kl_loss(*leaves, seq, teacher=t, selection=ids, topk=4, kpool=2)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=0)
    for name, a, b in zip(NAMES, torch.autograd.grad(loss, leaves), ref_grads):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-5 * float(b.abs().max()), msg=name)
    leaves = [v.detach().bfloat16().requires_grad_() for v in ref_leaves]
    naive = [v.detach().clone().requires_grad_() for v in leaves]
    loss = indexer_kl_loss(*leaves, seq, teacher=t, selection=ids, topk=4, kpool=2)
    ref = kl_loss_reference(*naive, x.cu_seq_lens, selection=ids.long(), **ref_kw)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    for name, a, b in zip(NAMES, torch.autograd.grad(loss, leaves), torch.autograd.grad(ref, naive)):
        assert a.dtype == torch.bfloat16, name
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=2e-2 * float(b.abs().max()), msg=name)


def test_no_candidates_and_local_rows():
    """Rows without a complete pool add nothing and count nowhere; ``local_rows`` divides by
    this rank's such rows; a sequence without any pool gives 0 and zero gradients."""
    x, teacher = training_case([1, 1, 2], kpool=4, heads=2, head_dim=4)
    seq = layout_seqs(x.cu_seq_lens, 1)[0]
    leaves = _leaves(x)
    t = AttentionTeacher(*teacher, 0.5)
    loss = indexer_kl_loss(*leaves, seq, teacher=t, selection="dense", topk=4, kpool=4)
    assert float(loss.detach()) == 0
    assert all(bool((g == 0).all()) for g in torch.autograd.grad(loss, leaves))
    x, teacher = training_case(LENGTHS, kpool=2, heads=3, head_dim=4)
    seq = layout_seqs(x.cu_seq_lens, 1)[0]
    t = AttentionTeacher(*teacher, 0.5)
    glob = indexer_kl_loss(*_leaves(x), seq, teacher=t, selection="dense", topk=4, kpool=2)
    local = indexer_kl_loss(*_leaves(x), seq, teacher=t, selection="dense", topk=4, kpool=2, normalize="local_rows")
    torch.testing.assert_close(glob, local)  # one rank: every row is local
    half = indexer_kl_loss(*_leaves(x), seq, teacher=t, selection="dense", topk=4, kpool=2, coeff=0.5)
    torch.testing.assert_close(half, glob * 0.5)


def test_loss_independent_of_column_order():
    """The candidates are sets: the ids in score order (another column layout) give the
    same loss bit for bit."""
    x, teacher = training_case(LENGTHS, kpool=2, heads=3, head_dim=4)
    seq = layout_seqs(x.cu_seq_lens, 1)[0]
    t = AttentionTeacher(*teacher, 0.5)
    asc = indexer_kl_loss(*_leaves(x), seq, teacher=t, selection=_ids(x, seq, 4), topk=4, kpool=2)
    by_score = sp_kpool.kpool_topk(x.q.float(), x.k.float(), x.gates.float(), x.head_weights.float(), x.ape.float(),
                                   seq, topk=4, kpool=2, order="score", tail="compact")  # fmt: skip
    other = indexer_kl_loss(*_leaves(x), seq, teacher=t, selection=by_score, topk=4, kpool=2)
    assert torch.equal(asc, other)


# (world size, layout, gather, determinism, sparse, teacher, dtype)
RANK_CASES = [
    (2, "contiguous", "keys", "ordered", True, "mass", torch.float64),
    (3, "contiguous", "pools", "exact", False, "attention", torch.float64),
    (4, "contiguous", "pools", "ordered", True, "attention", torch.float32),
    (3, "zigzag", "pools", "exact", True, "mass", torch.float64),
    (2, "zigzag-per-document", "keys", "ordered", False, "attention", torch.float32),
    (4, "positions", "pools", "exact", False, "attention", torch.float64),
    (3, "positions", "keys", "ordered", True, "mass", torch.float64),
    (4, "zigzag", "keys", "exact", True, "attention", torch.float32),
    # balance="causal" (a small budget: chunks of a few rows, so that the partition applies)
    (3, "contiguous", "keys", "exact", False, "attention", torch.float64, "causal"),
    (2, "zigzag-per-document", "pools", "ordered", True, "mass", torch.float64, "causal"),
    (4, "positions", "keys", "exact", True, "attention", torch.float32, "causal"),
]


@pytest.mark.xdist_group("ranks")
@pytest.mark.parametrize("case", RANK_CASES, ids=lambda c: "-".join(str(v).replace("torch.", "") for v in c))
def test_ranks_equal_world_size_1(case):
    """The shares' sum and every gradient equal world size 1's: ordered within the issue's
    tolerance (1e-9 max|g| float64, 1e-5 max|g| FP32), exact bit for bit (the loss and ape
    whole on rank 0); two calls bit for bit; padding rows' gradients zero; with
    ``balance="causal"`` the partition applies (rows computed by other ranks)."""
    W, layout, gather, det, sparse, kind, dtype = case[:7]
    kw = dict(gather=gather, determinism=det)
    if len(case) > 7:
        kw.update(balance=case[7], max_logits_bytes=1 << 12)
    results = run_ranks(compare_with_world1, W, ([13, 7, 5, 1, 9, 2], layout, kw, sparse, kind, 4, dtype), timeout=240)
    assert any(r["balance_applied"] for r in results) == (len(case) > 7)
    tol = 1e-9 if dtype == torch.float64 else 1e-5
    for r, res in enumerate(results):
        assert res["repeat_bitwise"] and res["padding_zero"], r
        total, one = res["loss"]
        assert one > 0
        if det == "exact":
            assert res["loss_bitwise"], (r, res["loss"])
        else:
            assert abs(total - one) <= tol * abs(one), (r, res["loss"])
        for name, (diff, scale, bitwise) in res["grads"].items():
            assert scale > 0, (r, name)
            if det == "exact":
                assert bitwise, (r, name, diff)
            else:
                assert diff <= tol * scale, (r, name, diff, scale)


def _bad_mass_on_rank_1(rank, world_size):
    import torch.distributed as dist

    x, teacher = training_case(LENGTHS, kpool=2, heads=2, head_dim=4)
    seq = sp_kpool.ShardedSequence.split(x.cu_seq_lens, world_size, rank, dist.group.WORLD)
    local = [seq.local_rows(getattr(x, n)) for n in ("q", "k", "gates", "head_weights")]
    ids = sp_kpool.kpool_topk(*local, x.ape, seq, topk=4, kpool=2)
    mass = (ids >= 0).double()
    if rank == 1:
        mass[seq.padding_rows.logical_not().nonzero()[0, 0], 0] = -1.0
    try:
        indexer_kl_loss(*local, x.ape, seq, teacher=TokenMass(mass), selection=ids, topk=4, kpool=2)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.xdist_group("ranks")
def test_bad_teacher_on_one_rank_raises_on_every_rank():
    messages = run_ranks(_bad_mass_on_rank_1, 3, timeout=120)
    assert messages[0] is not None and len(set(messages)) == 1, messages
    assert "rank 1" in messages[0] and "teacher.mass: expected finite values >= 0" in messages[0]


def test_errors_name_the_argument():
    x, teacher = training_case(LENGTHS, kpool=2, heads=2, head_dim=4)
    seq = layout_seqs(x.cu_seq_lens, 1)[0]
    ids = _ids(x, seq, 4)
    args = [x.q, x.k, x.gates, x.head_weights, x.ape, seq]
    good = TokenMass((ids >= 0).double())
    att = AttentionTeacher(*teacher, 0.5)

    def call(**kw):
        base = dict(teacher=good, selection=ids, topk=4, kpool=2)
        return indexer_kl_loss(*args, **{**base, **kw})

    with pytest.raises(ValueError, match=r"selection: expected shape \[24, 5\]"):
        call(selection=ids[:, :4])
    with pytest.raises(TypeError, match="selection: expected kpool_topk's ids"):
        call(selection=ids.float())
    with pytest.raises(ValueError, match="teacher: TokenMass holds the mass of selected ids"):
        call(selection="dense")
    with pytest.raises(ValueError, match="precision: the training path computes the bf16 model arithmetic"):
        call(precision="fp8")
    with pytest.raises(ValueError, match="teacher.mass: expected 0 where the selection's id is -1"):
        call(teacher=TokenMass(torch.ones(ids.shape, dtype=torch.float64)))
    with pytest.raises(ValueError, match="teacher.mass: expected finite values >= 0, got nan"):
        call(teacher=TokenMass(torch.where(ids >= 0, float("nan"), 0.0)))
    moved = ids.clone()
    moved[20, 0] = 23  # a later token of its document: not selectable by row 20
    with pytest.raises(ValueError, match="selection: row 20 .* holds id 23, which that row cannot select"):
        call(selection=moved, teacher=att)
    half = ids.clone()
    half[20, 1] = -1  # one id of a pool missing
    with pytest.raises(ValueError, match="selection: row 20 .* holds 1 ids of pool"):
        call(selection=half, teacher=att)
    with pytest.raises(ValueError, match=r"teacher.k: expected shape \[24, 5\]"):
        call(teacher=AttentionTeacher(teacher[0], teacher[1][:-1], teacher[2], 0.5))
    with pytest.raises(TypeError, match="teacher.lse: expected dtype in"):
        call(teacher=AttentionTeacher(teacher[0], teacher[1], teacher[2].half(), 0.5))
    with pytest.raises(ValueError, match="teacher.scale: expected a finite float > 0"):
        call(teacher=AttentionTeacher(*teacher, -1.0))
    with pytest.raises(TypeError, match="teacher: expected sp_kpool.TokenMass or sp_kpool.AttentionTeacher"):
        call(teacher=ids)
    with pytest.raises(ValueError, match="normalize: expected one of"):
        call(normalize="mean")
    with pytest.raises(TypeError, match="indexer_kl_loss: unexpected keyword argument"):
        call(topk_=3)


def test_trainable_module_equals_the_definition():
    """``KPoolIndexer(trainable=True)``: forward returns the frozen module's ids, ``kl_loss``
    backpropagates to every parameter; loss and parameter gradients equal the naive
    reference's on the module's own projections (float64)."""
    from sp_kpool.testing.training_checks import indexer_module, module_inputs

    lengths = [9, 6, 3, 1, 5]
    hidden, q_resid, (qt, kt, lse) = module_inputs(lengths)
    seq = layout_seqs([0, 9, 15, 18, 19, 24], 1)[0]
    m = indexer_module()
    frozen = indexer_module()
    frozen.trainable = False
    frozen.requires_grad_(False)
    ids = m(hidden, q_resid, seq)
    assert torch.equal(ids, frozen(hidden, q_resid, seq))
    for dense in (False, True):
        m.zero_grad()
        loss = m.kl_loss(AttentionTeacher(qt, kt, lse, 0.4), selection="dense" if dense else None)
        loss.backward()
        ours = {n: p.grad.clone() for n, p in m.named_parameters()}
        ref_m = indexer_module()
        p = ref_m.project(hidden, q_resid, "bf16")
        ref = kl_loss_reference(p["q"], p["k"], p["gates"], p["head_weights"], p["ape"], seq.cu_seq_lens,
                                selection=None if dense else seq.real_ids(ids).long(),
                                attention=(qt, kt, lse, 0.4))  # fmt: skip
        ref.backward()
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
        for name, q in ref_m.named_parameters():
            assert float(q.grad.abs().max()) > 0, name
            torch.testing.assert_close(ours[name], q.grad, rtol=0, atol=1e-11 * float(q.grad.abs().max()), msg=name)
    with pytest.raises(RuntimeError, match="kl_loss: the indexer was built with trainable=False"):
        frozen.kl_loss(AttentionTeacher(qt, kt, lse, 0.4))
    with pytest.raises(RuntimeError, match="kl_loss: no forward call"):
        indexer_module().kl_loss(AttentionTeacher(qt, kt, lse, 0.4))
    assert not any(p.requires_grad for p in frozen.parameters())


def test_trainable_module_under_compile_is_a_graph_break():
    """Under torch.compile the loss runs eagerly (a documented graph break): same loss and
    gradients as eager."""
    from sp_kpool.testing.training_checks import indexer_module, module_inputs

    hidden, q_resid, (qt, kt, lse) = module_inputs([7, 5])
    seq = layout_seqs([0, 7, 12], 1)[0]
    teacher = AttentionTeacher(qt, kt, lse, 0.4)
    results = []
    for compiled in (False, True):
        m = indexer_module()

        def step(h, r):
            m(h, r, seq)
            return m.kl_loss(teacher, selection="dense")

        fn = torch.compile(step, backend="eager") if compiled else step
        loss = fn(hidden, q_resid)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in m.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


@pytest.mark.xdist_group("ranks")
@pytest.mark.parametrize("case", [(2, "contiguous", "ordered", False), (3, "zigzag", "exact", True)],
                         ids=lambda c: "-".join(map(str, c)))  # fmt: skip
def test_trainable_module_ranks_equal_world_size_1(case):
    """A training step on gloo ranks: the parameter gradients summed over the ranks (what the
    framework's all-reduce does) equal world size 1's within 1e-9 max|g| (float64; the
    parameters the module stores in FP32 within 1e-5): the per-rank parameter gradients
    are sums over each rank's rows, regrouped by the framework's sum."""
    from sp_kpool.testing.training_checks import module_step

    W, layout, det, dense = case
    results = run_ranks(module_step, W, ([13, 7, 5, 1, 9, 2], layout, det, dense), timeout=240)
    for res in results:
        total, one = res["loss"]
        assert one > 0 and abs(total - one) <= 1e-12 * one
        for name, (diff, scale, _) in res["grads"].items():
            tol = 1e-5 if name in sp_kpool.KPoolIndexer.FP32_PARAMETERS else 1e-9  # stored FP32 (serving's)
            assert scale > 0 and diff <= tol * scale, (name, diff, scale)


def _heads_split(rank, world_size):
    """Tensor parallelism: each rank holds its share of the attention's heads (same rows);
    the teacher's head sum is all-reduced over ``head_group``."""
    import torch.distributed as dist

    x, (qt, kt, lse) = training_case(LENGTHS, kpool=2, heads=2, head_dim=4, hq=4)
    seq = layout_seqs(x.cu_seq_lens, 1)[0]
    mine = slice(rank * 2, rank * 2 + 2)
    full = indexer_kl_loss(*_leaves(x), seq, teacher=AttentionTeacher(qt, kt, lse, 0.5), selection="dense", topk=4,
                           kpool=2)  # fmt: skip
    part = AttentionTeacher(qt[:, mine].contiguous(), kt, lse[:, mine].contiguous(), 0.5, head_group=dist.group.WORLD)
    split = indexer_kl_loss(*_leaves(x), seq, teacher=part, selection="dense", topk=4, kpool=2)
    alone = indexer_kl_loss(*_leaves(x), seq, teacher=AttentionTeacher(qt[:, mine], kt, lse[:, mine], 0.5),
                            selection="dense", topk=4, kpool=2)  # fmt: skip
    return float(full.detach()), float(split.detach()), float(alone.detach())


@pytest.mark.xdist_group("ranks")
def test_head_group_sums_the_heads():
    for full, split, alone in run_ranks(_heads_split, 2, timeout=120):
        assert abs(split - full) <= 1e-12 * full and abs(alone - full) > 1e-6 * full
