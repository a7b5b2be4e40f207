"""KPoolIndexer against transformers' Glm5NextTextIndexer (FP32), as per-row sets."""

import pytest
import torch

from sp_kpool import KPoolIndexer, ShardedSequence
from sp_kpool.testing.invariants import check_invariants, row_token_sets
from sp_kpool.testing.reference import float64_scores, tie_aware_mismatches, transformers_indexer, transformers_rows

pytest.importorskip("transformers.models.glm5_next", reason="needs transformers with glm5_next (the 'test' extra)")

HIDDEN, QLORA, HEADS, HEAD_DIM = 48, 24, 8, 16

CASES = [
    # (document lengths, kpool, topk): odd lengths, single-token documents, documents
    # shorter than kpool and longer than topk
    ([37, 1, 3, 64, 2, 45], 4, 16),
    ([1, 1, 1, 2], 4, 8),
    ([29, 5, 1, 40], 1, 8),
    ([23, 2, 31], 2, 8),
    ([70, 15, 100, 3], 16, 32),
    ([129], 4, 2048),
]


def _run(lengths, kpool, topk, world_size=1):
    ref = transformers_indexer(
        hidden_size=HIDDEN, q_lora_rank=QLORA, heads=HEADS, head_dim=HEAD_DIM, topk=topk, kpool=kpool, seed=sum(lengths)
    )
    ours = KPoolIndexer(
        hidden_size=HIDDEN, q_lora_rank=QLORA, index_n_heads=HEADS, index_head_dim=HEAD_DIM,
        index_topk=topk, index_kpool=kpool,
    )  # fmt: skip
    ours.load_state_dict(ref.state_dict(), strict=True)
    S = sum(lengths)
    g = torch.Generator().manual_seed(len(lengths))
    hidden, q_resid = torch.randn(S, HIDDEN, generator=g), torch.randn(S, QLORA, generator=g)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    ref_sets = transformers_rows(ref, hidden, q_resid, cu)
    seq = ShardedSequence.split(cu, world_size=1, rank=0)
    out = ours(hidden, q_resid, seq)
    check_invariants(out, seq, topk=topk, kpool=kpool, tail="fixed")
    inputs = ours.prepare(hidden, q_resid)
    scores, token_pool = float64_scores(
        inputs["q"], inputs["k"], inputs["gates"], inputs["head_weights"], inputs["ape"], cu, kpool
    )
    return row_token_sets(out), ref_sets, scores, token_pool, cu


@pytest.mark.parametrize("lengths, kpool, topk", CASES)
def test_matches_transformers_per_row_sets(lengths, kpool, topk):
    ours, ref, scores, token_pool, cu = _run(lengths, kpool, topk)
    assert len(ours) == len(ref) == sum(lengths)
    bad = tie_aware_mismatches(ours, ref, scores, token_pool, cu, topk=topk, kpool=kpool)
    assert not bad, f"{len(bad)} rows differ beyond near-ties, first: {bad[:3]}"
    # the comparison is not vacuous: rows with a real choice exist and most agree exactly
    assert sum(a == b for a, b in zip(ours, ref)) >= 0.95 * len(ours)


def test_tie_aware_check_rejects_a_real_difference():
    ours, ref, scores, token_pool, cu = _run([64, 33], 4, 16)
    t = 40  # document 0, 10 visible pools, 4 selected
    chosen = {int(token_pool[v]) for v in ref[t] if token_pool[v] >= 0}
    visible = {int(token_pool[x]) for x in range(0, t + 1) if token_pool[x] >= 0 and x <= t - (t + 1) % 4}
    worst = min(visible - chosen, key=lambda p: float(scores[t, p]))
    best = max(chosen, key=lambda p: float(scores[t, p]))
    swapped = set(ref[t]) - {v for v in ref[t] if token_pool[v] == best} | {v for v in range(64) if token_pool[v] == worst}
    corrupted = list(ref)
    corrupted[t] = frozenset(swapped)
    bad = tie_aware_mismatches(corrupted, ref, scores, token_pool, cu, topk=16, kpool=4)
    assert [b[0] for b in bad] == [t]


def test_state_dict_names_match_checkpoint():
    m = KPoolIndexer(hidden_size=8, q_lora_rank=4, index_n_heads=2, index_head_dim=4, index_topk=8)
    assert sorted(m.state_dict()) == sorted([
        "wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight",
        "index_kpool_compress_gate", "index_kpool_compress_ape",
    ])  # fmt: skip
    assert not any(p.requires_grad for p in m.parameters())


def test_indexer_scale_keywords_change_no_bit():
    kw = dict(hidden_size=32, q_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=16)
    plain = KPoolIndexer(**kw)
    scaled = KPoolIndexer(**kw, gather="pools", balance="causal", balance_block=8, balance_row_cost=3)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in plain.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    scaled.load_state_dict(plain.state_dict(), strict=True)
    hidden, q_resid = torch.randn(77, 32, generator=g), torch.randn(77, 16, generator=g)
    seq = ShardedSequence.split([0, 40, 77], world_size=1, rank=0)
    assert torch.equal(plain(hidden, q_resid, seq), scaled(hidden, q_resid, seq))
    assert scaled.options.gather == "pools" and scaled.options.balance == "causal"


def test_bf16_checkpoint_loads_exactly_and_the_model_arithmetic_is_unchanged():
    # serving builds the head gate and the key norm in FP32: we store them so whatever the
    # module dtype; a BF16 checkpoint (transformers' indexer in BF16) loads with strict=True
    # and exactly, and the bf16 arithmetic computes with them in the module dtype, as
    # transformers' own modules do
    ref = transformers_indexer(hidden_size=HIDDEN, q_lora_rank=QLORA, heads=HEADS, head_dim=HEAD_DIM, topk=16, kpool=4,
                               seed=3).bfloat16()  # fmt: skip
    ours = KPoolIndexer(hidden_size=HIDDEN, q_lora_rank=QLORA, index_n_heads=HEADS, index_head_dim=HEAD_DIM,
                        index_topk=16, index_kpool=4, dtype=torch.bfloat16, precision="bf16")  # fmt: skip
    ours.load_state_dict(ref.state_dict(), strict=True)
    for name, p in ours.named_parameters():
        want = torch.float32 if name in KPoolIndexer.FP32_PARAMETERS else torch.bfloat16
        assert p.dtype == want, name
        assert torch.equal(p.float(), ref.state_dict()[name].float()), name
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(30, HIDDEN, generator=g).bfloat16()
    q_resid = torch.randn(30, QLORA, generator=g).bfloat16()
    got = ours.prepare(hidden, q_resid)
    with torch.no_grad():
        assert torch.equal(got["k"], ref.k_norm(ref.wk(hidden)))
        assert torch.equal(got["head_weights"], ref.weights_proj(hidden))
    assert got["head_weights"].dtype == torch.bfloat16
    # a dtype conversion of the module keeps them FP32 (values and all)
    before = ours.weights_proj.weight.clone()
    ours.half()
    assert ours.weights_proj.weight.dtype == torch.float32 and torch.equal(ours.weights_proj.weight, before)
    assert ours.wk.weight.dtype == torch.float16 and ours.k_norm.bias.dtype == torch.float32
