"""sp_kpool.integrations.transformers: our indexer inside a real transformers GLM-5.3 model.

A tiny randomly initialised ``Glm5NextForConditionalGeneration`` (CPU, FP32; layers 0 and 2
run an indexer, layer 1 shares layer 0's selection) gives the same logits, bit for bit,
with our indexer swapped in, on batches with padding: the attention turns the ids into a
mask per row, so equal per-row sets give equal arithmetic downstream.
"""

import copy
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers.models.glm5_next", reason="needs transformers with glm5_next (the 'test' extra)")

from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration  # noqa: E402

from sp_kpool.integrations.transformers import (  # noqa: E402
    CONFIG_FIELDS,
    TransformersKPoolIndexer,
    replace_indexers,
)
from sp_kpool.testing.reference import transformers_indexer  # noqa: E402

VOCAB, S, TOPK, KPOOL = 97, 40, 8, 4


def tiny_model(seed=0, **text_overrides):
    text = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=0, qk_nope_head_dim=16,
        v_head_dim=16, index_topk=TOPK, index_head_dim=16, index_n_heads=32, index_kpool=KPOOL,
        layer_types=["full_attention"] * 3, indexer_types=["full", "shared", "full"],
        mlp_layer_types=["dense"] * 3, hc_mult=2, pad_token_id=0,
    )  # fmt: skip
    text.update(text_overrides)
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=64,
                  projection_intermediate_size=16, patch_size=2, image_size=8)  # fmt: skip
    torch.manual_seed(seed)
    return Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=vision)).float().eval()


def batch(padding_side, seed=1):
    """3 rows of S tokens: one unpadded, 9 and 25 padding tokens (15 real: > topk + K - 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, S), generator=g)
    mask = torch.ones(3, S, dtype=torch.long)
    for row, pad in ((1, 9), (2, 25)):
        if padding_side == "left":
            mask[row, :pad] = 0
        else:
            mask[row, S - pad :] = 0
    return ids.masked_fill(mask == 0, 0), mask


def indexers(model):
    return [l.self_attn.indexer for l in model.model.language_model.layers if l.self_attn.indexer is not None]


@torch.no_grad()
def run(model, ids, mask):
    """(logits, per indexer layer its output [B, S, width])."""
    outs = []
    hooks = [m.register_forward_hook(lambda mod, args, kw, out: outs.append(out), with_kwargs=True)
             for m in indexers(model)]  # fmt: skip
    try:
        logits = model(input_ids=ids, attention_mask=mask).logits
    finally:
        for h in hooks:
            h.remove()
    return logits, outs


def row_sets(ids):
    return [[frozenset(v for v in r.tolist() if v >= 0) for r in row] for row in ids]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny matrices, one thread


@pytest.fixture(scope="module")
def base(one_thread):
    return tiny_model()


@pytest.mark.parametrize("padding_side, tail", [("left", True), ("right", True), ("left", False)])
def test_same_logits_with_our_indexer(base, padding_side, tail):
    ref = base if tail else tiny_model(index_kpool_always_select_tail=False)
    ours = copy.deepcopy(ref)
    assert replace_indexers(ours, precision="bf16") == 2  # layers 0 and 2 (layer 1 shares)
    assert all(isinstance(m, TransformersKPoolIndexer) for m in indexers(ours))
    ids, mask = batch(padding_side)
    want, want_ids = run(ref, ids, mask)
    got, got_ids = run(ours, ids, mask)
    width = TOPK + (KPOOL - 1 if tail else 0)
    for a, b in zip(want_ids, got_ids):
        assert a.shape == b.shape == (3, S, width) and a.dtype == b.dtype == torch.int32
        assert row_sets(a) == row_sets(b)
        real = mask.bool()
        assert (b[~real] == -1).all()  # padded query rows: nothing, as transformers
        for row in range(3):  # no padded key is ever selected
            sel = b[row][b[row] >= 0].long()
            assert real[row, sel].all()
    # the selection is sparse (most rows see fewer keys than their causal prefix) ...
    sizes = torch.tensor([[len(s) for s in r] for r in row_sets(got_ids[0])])
    causal = mask.cumsum(1)
    assert (sizes < causal).sum() > 50
    # ... and the logits equal bit for bit (padded rows included)
    assert got.shape == (3, S, VOCAB)
    assert torch.equal(got, want)


def test_compiled_model_same_logits(base, monkeypatch):
    # torch.compile of the whole model (transformers' own code breaks the graph in places): our
    # indexer goes through the opaque custom operator, and the logits equal the eager model's
    # (and transformers' indexer's) bit for bit on two batches of different padding
    import sp_kpool.op as op

    ours = copy.deepcopy(base)
    replace_indexers(ours, precision="bf16")
    traced = []
    inner = op.kpool_topk_traced
    monkeypatch.setattr(op, "kpool_topk_traced", lambda *a, **k: traced.append(1) or inner(*a, **k))
    torch._dynamo.reset()
    compiled = torch.compile(ours, backend="eager", dynamic=True)  # dynamo, its fake tensors
    try:
        with torch.no_grad():
            for padding_side, seed in (("left", 1), ("right", 3)):
                ids, mask = batch(padding_side, seed=seed)
                want = base(input_ids=ids, attention_mask=mask).logits
                assert torch.equal(compiled(input_ids=ids, attention_mask=mask).logits, want)
    finally:
        torch._dynamo.reset()
    assert traced  # the indexer was traced as the custom operator, not run eagerly


def test_logits_comparison_can_fail(base):
    ours = copy.deepcopy(base)
    replace_indexers(ours, precision="bf16")
    with torch.no_grad():
        indexers(ours)[0].wq_b.weight.neg_()  # another selection
    ids, mask = batch("left")
    want, _ = run(base, ids, mask)
    got, _ = run(ours, ids, mask)
    assert not torch.equal(got, want)


def test_fp8_end_to_end(base):
    ours = copy.deepcopy(base)
    assert replace_indexers(ours, precision="fp8") == 2
    ids, mask = batch("left")
    logits, outs = run(ours, ids, mask)
    assert logits.shape == (3, S, VOCAB) and torch.isfinite(logits).all()
    real = mask.bool()
    for out in outs:
        assert out.shape == (3, S, TOPK + KPOOL - 1) and out.dtype == torch.int32
        pos = torch.arange(S)
        assert ((out < 0) | (out <= pos[None, :, None])).all()  # causal
        assert (out[~real] == -1).all()
        assert all(real[r, out[r][out[r] >= 0].long()].all() for r in range(3))
        assert (out[real] >= 0).any(1).all()  # every real row sees something (its own tail at least)


def test_generate_prefill_ours_decode_transformers(base):
    ours = copy.deepcopy(base)
    replace_indexers(ours, precision="bf16")
    calls = {"ours": 0, "transformers": 0}
    for m in indexers(ours):
        kp, orig = m.kpool_forward, m.__dict__["_original"]
        m.kpool_forward = lambda *a, _f=kp: (calls.__setitem__("ours", calls["ours"] + 1), _f(*a))[1]
        orig.register_forward_hook(lambda *a: calls.__setitem__("transformers", calls["transformers"] + 1))
    ids, mask = batch("left")
    with torch.no_grad():
        want = base.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        got = ours.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, want)
    assert calls == {"ours": 2, "transformers": 4}  # prefill: 2 layers ours; 2 decode steps x 2 layers


def test_bf16_model_same_logits_and_generation(base):
    # a BF16 model: we keep the head gate and the key norm in FP32 (their BF16 values,
    # exactly) and compute with them in BF16, as transformers; the decode steps get them
    # cast back for transformers' arithmetic
    ref = copy.deepcopy(base).to(torch.bfloat16)
    ours = copy.deepcopy(ref)
    replace_indexers(ours, precision="bf16")
    assert indexers(ours)[0].weights_proj.weight.dtype == torch.float32
    assert indexers(ours)[0].wq_b.weight.dtype == torch.bfloat16
    ids, mask = batch("right")
    want, want_ids = run(ref, ids, mask)
    got, got_ids = run(ours, ids, mask)
    assert all(row_sets(a) == row_sets(b) for a, b in zip(want_ids, got_ids))
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    ids, mask = batch("left")
    with torch.no_grad():
        want = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
        got = ours.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, want)


def test_weights_and_state_dict_unchanged(base):
    ours = copy.deepcopy(base)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    originals = [m for m in indexers(ours)]
    replace_indexers(ours)
    after = ours.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    for orig, new in zip(originals, indexers(ours)):  # one copy: the transformers module holds ours
        assert orig.wq_b.weight is new.wq_b.weight and orig.index_kpool_compress_gate is new.index_kpool_compress_gate
        assert new.layer_idx == orig.layer_idx
    assert replace_indexers(ours) == 0  # already ours


def test_module_forward_matches_transformers_module():
    # the module on its own, with transformers' contract: a row of padding only, left and
    # right padding, an int mask; random weights of unit scale (sharp choices)
    ref = transformers_indexer(hidden_size=48, q_lora_rank=24, heads=8, head_dim=16, topk=16, kpool=4, seed=5)
    ours = TransformersKPoolIndexer.from_transformers(ref, precision="bf16")
    g = torch.Generator().manual_seed(6)
    hidden, q_resid = torch.randn(4, 50, 48, generator=g), torch.randn(4, 50, 24, generator=g)
    mask = torch.ones(4, 50, dtype=torch.bool)
    mask[1, :13] = False
    mask[2, 31:] = False
    mask[3] = False
    with torch.no_grad():
        want = ref(hidden, q_resid, mask, None)
    got = ours(hidden, q_resid, mask.int(), None)
    assert got.shape == want.shape == (4, 50, 19) and got.dtype == torch.int32
    assert row_sets(got) == row_sets(want)
    assert (got[3] == -1).all()
    assert torch.equal(ours(hidden, q_resid, None), ours(hidden, q_resid, torch.ones(4, 50, dtype=torch.bool)))
    nothing = torch.zeros(4, 50, dtype=torch.bool)  # a batch of padding only
    with torch.no_grad():
        assert torch.equal(ours(hidden, q_resid, nothing), ref(hidden, q_resid, nothing, None))
    assert (ours(hidden, q_resid, nothing) == -1).all()


def test_a_mask_changed_in_place_is_seen():
    ref = transformers_indexer(hidden_size=48, q_lora_rank=24, heads=8, head_dim=16, topk=8, kpool=4, seed=7)
    ours = TransformersKPoolIndexer.from_transformers(ref)
    g = torch.Generator().manual_seed(8)
    hidden, q_resid = torch.randn(2, 30, 48, generator=g), torch.randn(2, 30, 24, generator=g)
    mask = torch.ones(2, 30, dtype=torch.bool)
    first = ours(hidden, q_resid, mask)
    mask[0, :10] = False  # same tensor, new contents
    second = ours(hidden, q_resid, mask)
    assert torch.equal(second, ours(hidden, q_resid, mask.clone()))
    assert not torch.equal(first, second) and (second[0, :10] == -1).all()


# -- bad input -------------------------------------------------------------------------


def test_bad_models_and_names(base):
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        replace_indexers("not a model")
    with pytest.raises(ValueError, match="no Glm5NextTextIndexer in this Linear"):
        replace_indexers(torch.nn.Linear(2, 2))
    ours = copy.deepcopy(base)
    with pytest.raises(ValueError, match="precision"):
        replace_indexers(ours, precision="fp16")
    with pytest.raises(ValueError, match="backend"):
        replace_indexers(ours, backend="cutlass")
    with pytest.raises(ValueError, match="is itself a Glm5NextTextIndexer"):
        replace_indexers(indexers(ours)[0])
    assert not any(isinstance(m, TransformersKPoolIndexer) for m in indexers(ours))  # untouched


@pytest.mark.parametrize("field", ["index_kpool", "index_topk", "q_lora_rank", "index_kpool_always_select_tail"])
def test_a_config_field_missing_is_named(base, field):
    ours = copy.deepcopy(base)
    victim = indexers(ours)[1]
    cfg = victim.config
    victim.config = SimpleNamespace(**{f: getattr(cfg, f) for f in CONFIG_FIELDS if f != field})
    where = r"model\.language_model\.layers\.2\.self_attn\.indexer"
    with pytest.raises(ValueError, match=rf"{where}: config\.{field} is missing"):
        replace_indexers(ours)
    assert not any(isinstance(m, TransformersKPoolIndexer) for m in indexers(ours))  # nothing replaced


def test_config_values_and_weights_checked(base):
    ours = copy.deepcopy(base)
    victim = indexers(ours)[0]
    fields = {f: getattr(victim.config, f) for f in CONFIG_FIELDS}
    victim.config = SimpleNamespace(**{**fields, "index_topk": 6})
    with pytest.raises(ValueError, match="config.index_topk: expected a multiple of config.index_kpool = 4, got 6"):
        replace_indexers(ours)
    victim.config = SimpleNamespace(**{**fields, "index_head_dim": 8})
    with pytest.raises(ValueError, match="weights of the Glm5NextTextIndexer do not fit its config"):
        replace_indexers(ours)
    victim.config = SimpleNamespace(**{**fields, "index_kpool_always_select_tail": "yes"})
    with pytest.raises(TypeError, match="config.index_kpool_always_select_tail: expected a bool"):
        replace_indexers(ours)


def test_bad_forward_input_names_the_field():
    ref = transformers_indexer(hidden_size=48, q_lora_rank=24, heads=8, head_dim=16, topk=8, kpool=4)
    ours = TransformersKPoolIndexer.from_transformers(ref)
    h, q = torch.randn(2, 10, 48), torch.randn(2, 10, 24)
    hole = torch.ones(2, 10, dtype=torch.bool)
    hole[1, 4] = False
    with pytest.raises(ValueError, match="attention_mask: row 1 is not one contiguous run"):
        ours(h, q, hole)
    with pytest.raises(ValueError, match=r"attention_mask: expected the 2-D padding mask \[B, S\] = \[2, 10\]"):
        ours(h, q, torch.ones(2, 1, 10, 10, dtype=torch.bool))
    with pytest.raises(TypeError, match="attention_mask: expected a bool"):
        ours(h, q, torch.ones(2, 10))
    with pytest.raises(ValueError, match=r"hidden_states: expected shape \[B, S, 48\]"):
        ours(h[0], q, None)
    with pytest.raises(ValueError, match=r"q_resid: expected \[B, S\] = \[2, 10\]"):
        ours(h, q[:, :9], None)
    with pytest.raises(ValueError, match="hidden_states: expected dtype torch.float32"):
        ours(h.double(), q, None)
    with pytest.raises(TypeError, match="cache: expected a transformers Cache"):
        ours(h, q, None, cache=object())
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        ours(h, q, None, position_ids=None)
