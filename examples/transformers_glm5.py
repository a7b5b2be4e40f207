"""Swap our KPool indexer into a transformers GLM-5.3 model and check it changes nothing.

    python examples/transformers_glm5.py                    # CPU
    python examples/transformers_glm5.py --device cuda      # a GPU (add --backend auto)

Builds a tiny randomly initialised ``Glm5NextForConditionalGeneration`` (FP32, 3 layers:
two run an indexer, one shares its selection), copies it, and runs
``sp_kpool.integrations.transformers.replace_indexers`` on the copy. Then, on a batch with
left padding (as ``generate`` pads), it checks that

1. the indexers select the same key set for every query (padded queries: none),
2. the logits are bitwise equal (the attention turns the ids into a mask),
3. greedy generation gives the same tokens (the prefill runs our indexer; the decode steps
   continue transformers' cache, which our prefill wrote),
4. ``precision="fp8"`` runs end to end (finite logits).

Prints ``PASS`` and exits 0, or ``FAIL: ...`` and exits 1. Needs ``transformers`` >= 5.17.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch

from sp_kpool.testing.dist import device_flag


def tiny_glm5(device: str, seed: int = 0):
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    text = dict(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=0, qk_nope_head_dim=16,
        v_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=32, index_kpool=4,
        layer_types=["full_attention"] * 3, indexer_types=["full", "shared", "full"],
        mlp_layer_types=["dense"] * 3, hc_mult=2, pad_token_id=0,
    )  # fmt: skip
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=64,
                  projection_intermediate_size=16, patch_size=2, image_size=8)  # fmt: skip
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text, vision_config=vision))
    return model.float().eval().to(device)


def indexers(model):
    return [l.self_attn.indexer for l in model.model.language_model.layers if l.self_attn.indexer is not None]


@torch.no_grad()
def logits_and_ids(model, ids, mask):
    outs = []
    hooks = [m.register_forward_hook(lambda mod, args, kw, out: outs.append(out.cpu()), with_kwargs=True)
             for m in indexers(model)]  # fmt: skip
    try:
        logits = model(input_ids=ids, attention_mask=mask).logits
    finally:
        for h in hooks:
            h.remove()
    return logits, outs


def row_sets(ids):
    return [frozenset(v for v in r.tolist() if v >= 0) for r in ids.flatten(0, 1)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=device_flag(), default="cpu", help="cpu (default), cuda or cuda:N")
    parser.add_argument("--backend", default="torch", help="kpool_topk backend (torch, triton, tilelang, deepgemm, auto)")
    parser.add_argument("--seq", type=int, default=40, help="tokens per row (default 40)")
    parser.add_argument("--perturb", action="store_true",
                        help="negate one indexer weight of the swapped model: the self-check must FAIL")  # fmt: skip
    args = parser.parse_args(argv)

    from sp_kpool.integrations.transformers import replace_indexers

    ref = tiny_glm5(args.device)
    ours = copy.deepcopy(ref)
    replaced = replace_indexers(ours, precision="bf16", backend=args.backend)
    print(f"replaced {replaced} Glm5NextTextIndexer modules")
    if args.perturb:
        with torch.no_grad():
            indexers(ours)[0].wq_b.weight.neg_()

    g = torch.Generator().manual_seed(1)
    S = args.seq
    ids = torch.randint(1, 97, (3, S), generator=g)
    mask = torch.ones(3, S, dtype=torch.long)
    mask[1, : S // 4] = 0  # left padding, as generate pads
    mask[2, : (5 * S) // 8] = 0
    ids = ids.masked_fill(mask == 0, 0).to(args.device)
    mask = mask.to(args.device)

    failures = []
    want, want_ids = logits_and_ids(ref, ids, mask)
    got, got_ids = logits_and_ids(ours, ids, mask)
    rows = agree = 0
    for a, b in zip(want_ids, got_ids):
        sa, sb = row_sets(a), row_sets(b)
        rows += len(sa)
        agree += sum(x == y for x, y in zip(sa, sb))
        if a.shape != b.shape or a.dtype != b.dtype:
            failures.append(f"indexer output {tuple(b.shape)} {b.dtype}, transformers {tuple(a.shape)} {a.dtype}")
    print(f"indexer rows with the same key set: {agree}/{rows}")
    if agree != rows:
        failures.append(f"{rows - agree} indexer rows differ")
    diff = (got - want).abs().max().item()
    print(f"logits {tuple(got.shape)}: bitwise equal {torch.equal(got, want)}, max |diff| {diff:.3g}")
    if not torch.equal(got, want):
        failures.append(f"logits differ (max |diff| {diff:.3g})")

    with torch.no_grad():
        gen_ref = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        gen_ours = ours.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    print(f"greedy generation (4 new tokens): same tokens {torch.equal(gen_ours, gen_ref)}")
    if not torch.equal(gen_ours, gen_ref):
        failures.append("generated tokens differ")

    fp8 = copy.deepcopy(ref)
    replace_indexers(fp8, precision="fp8", backend=args.backend)
    logits_fp8, _ = logits_and_ids(fp8, ids, mask)
    finite = bool(torch.isfinite(logits_fp8).all())
    print(f"fp8: logits {tuple(logits_fp8.shape)} finite {finite}, max |diff| to the model's "
          f"{(logits_fp8 - want).abs().max().item():.3g}")  # fmt: skip
    if not finite or logits_fp8.shape != want.shape:
        failures.append("fp8 logits not finite or of the wrong shape")

    if failures:
        print("FAIL: " + "; ".join(failures))
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
