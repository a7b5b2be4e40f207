"""Digest of the operator's outputs on fixed inputs: show that a change kept every bit.

    python scripts/output_digest.py write digest.json     # on the tree before a change
    python scripts/output_digest.py write after.json      # on the tree after it
    python scripts/output_digest.py compare digest.json after.json

``write`` runs, on the CPU, a fixed set of calls through the public API and records the
SHA-256 of every output tensor:

* the demo's problem (4099 tokens in 5 documents, H 16, D 64, topk 256) at world sizes
  1-4, split in one process (``sp_kpool.testing.problems.simulate_ranks``), for every
  precision, order, tail and two alignments, and a logits budget that forces many chunks;
* the same problem on 3 and 4 gloo ranks (real collectives) with ``gather="pools"`` and
  ``balance="causal"``;
* ``KPoolIndexer`` forward in every precision (random checkpoint-named weights);
* the parity replay of a synthetic capture (``fp8`` vs ``bf16-serving``, its pools,
  scores and Top-K statistics, timings and paths left out);
* ``sp_kpool.replay``: ``documents`` (token and pool-id captures), ``shard`` of both at
  world size 1 and ``shard_local`` at world sizes 2-4 in every layout, captures with
  uncovered rows (``missing="compute"`` and ``"empty"``), ``compare`` of a perturbed
  selection (with and without scores, on a row sample), and ``KPoolIndexer``'s
  ``mode="verify"`` (its ids and its report);
* the Triton kernels (``triton_topk``, ``triton_fp8_fused``, ``triton_serving``), the
  selector registry's table, and the ``triton`` and ``deepgemm`` backends with the
  stand-ins (``sp_kpool.testing.standins``), run on the CPU by Triton's interpreter in a
  child process (``TRITON_INTERPRET=1`` must be set before triton is first imported).

``compare`` prints each case that differs and exits 1 if any does. Runs with the package
installed (``pip install -e .``); takes a few minutes on two cores (the interpreted kernels
most of it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import torch

import sp_kpool
from sp_kpool.parity import make_synthetic_capture, replay
from sp_kpool.testing.dist import run_ranks
from sp_kpool.testing.problems import (
    layout_seqs,
    make_inputs,
    random_doc_lengths,
    random_rank_positions,
    shard_inputs,
    simulate_ranks,
)

LENGTHS = random_doc_lengths(4099, 5, seed=0)
SHAPE = dict(heads=16, head_dim=64, kpool=4)
TOPK = 256


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def _simulated(out: dict) -> None:
    x = make_inputs(LENGTHS, seed=0, **SHAPE)
    for precision in ("bf16", "bf16-serving", "fp8"):
        for order in ("ascending", "score"):
            for tail in ("fixed", "compact"):
                for alignment in (1, 64):
                    for budget in (None, 4 * 2**20):
                        opts = dict(precision=precision, order=order, tail=tail, alignment=alignment)
                        if budget is not None:
                            opts["max_logits_bytes"] = budget
                        for ws in (1, 2, 3, 4):
                            outs = simulate_ranks(x, ws, topk=TOPK, kpool=SHAPE["kpool"], **opts)
                            name = f"sim/{precision}/{order}/{tail}/a{alignment}/b{budget}/w{ws}"
                            out[name] = _sha(torch.cat(outs))


def _rank(rank: int, world_size: int, options: dict) -> str:
    x = make_inputs(LENGTHS, seed=0, **SHAPE)
    seq = sp_kpool.ShardedSequence.split(x.cu_seq_lens, world_size=world_size, rank=rank)
    ids = sp_kpool.kpool_topk(**shard_inputs(x, seq), seq=seq, topk=TOPK, kpool=SHAPE["kpool"], **options)
    return _sha(ids)


def _distributed(out: dict) -> None:
    for ws in (3, 4):
        for gather in ("keys", "pools"):
            for balance in ("none", "causal"):
                for precision in ("bf16", "fp8"):
                    opts = dict(gather=gather, balance=balance, precision=precision, max_logits_bytes=4 * 2**20)
                    shas = run_ranks(_rank, ws, (opts,), timeout=300)
                    for r, s in enumerate(shas):
                        out[f"dist/w{ws}/{gather}/{balance}/{precision}/rank{r}"] = s


def _indexer(out: dict) -> None:
    g = torch.Generator().manual_seed(1)
    hidden_size, q_lora_rank, H, D, K = 96, 48, 16, 64, 4
    hidden = torch.randn(LENGTHS[0], hidden_size, generator=g)
    q_resid = torch.randn(LENGTHS[0], q_lora_rank, generator=g)
    seq = sp_kpool.ShardedSequence.split([0, LENGTHS[0]], world_size=1, rank=0)
    for precision in ("bf16", "bf16-serving", "fp8"):
        mod = sp_kpool.KPoolIndexer(hidden_size=hidden_size, q_lora_rank=q_lora_rank, index_n_heads=H,
                                    index_head_dim=D, index_topk=TOPK, index_kpool=K, precision=precision)
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for p in mod.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        out[f"indexer/{precision}"] = _sha(mod(hidden, q_resid, seq))


def _scrub(x):
    """The report without wall times, paths and versions."""
    if isinstance(x, dict):
        return {k: _scrub(v) for k, v in x.items() if k not in ("seconds", "path", "files", "torch")}
    if isinstance(x, list):
        return [_scrub(v) for v in x]
    return x


def _parity(out: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_synthetic_capture(tmp, tokens=1030, docs=2, world_size=2, hidden_size=128, q_lora_rank=64,
                                       heads=16, head_dim=64, topk=256, kpool=4, dtype=torch.float32, seed=3)
        report = replay(paths[1], "fp8:torch", "bf16-serving:torch", device="cpu")
    text = json.dumps(_scrub(report), sort_keys=True, default=str)
    out["parity/synthetic"] = hashlib.sha256(text.encode()).hexdigest()


def _bytes_sha(*ts: torch.Tensor) -> str:
    """One digest of several tensors' bytes (any dtypes)."""
    return _sha(torch.cat([t.contiguous().view(torch.uint8).flatten() for t in ts]))


def _json_sha(x) -> str:
    return hashlib.sha256(json.dumps(x, sort_keys=True, default=str).encode()).hexdigest()


#: the replay cases' problem: small documents (one shorter than a pool, one of one token)
REPLAY_LENGTHS = [37, 5, 64, 1, 22]
REPLAY_CONFIGS = {
    "asc": dict(topk=16, kpool=4),
    "score-compact-a8": dict(topk=16, kpool=4, tail="compact", order="score", alignment=8),
    "k2-compact-a4": dict(topk=8, kpool=2, tail="compact", order="ascending", alignment=4),
}


def _perturbed(toks: list, kpool: int, topk: int, d: int = 2, rows=(40, 50)) -> list:
    """Token captures with, in document ``d``'s ``rows``, the lowest selected pool swapped for
    the lowest unselected visible one."""
    toks = [c.clone() for c in toks]
    for j in rows:
        row = toks[d][j]
        chosen = sorted({int(v) // kpool for v in row[:topk] if v >= 0 and v < (j + 1) // kpool * kpool})
        free = next(p for p in range((j + 1) // kpool) if p not in chosen)
        new = sorted(chosen[1:] + [free])
        toks[d][j, : len(new) * kpool] = torch.tensor([p * kpool + s for p in new for s in range(kpool)])
    return toks


def _replay(out: dict) -> None:
    from sp_kpool import KPoolConfig, replay

    cu = [0]
    for n in REPLAY_LENGTHS:
        cu.append(cu[-1] + n)
    for cname, c in REPLAY_CONFIGS.items():
        config = KPoolConfig(**c)
        x = make_inputs(REPLAY_LENGTHS, heads=8, head_dim=16, kpool=config.kpool, seed=5)
        seq1 = sp_kpool.ShardedSequence.split(x.cu_seq_lens, 1, 0)
        inputs = shard_inputs(x, seq1)
        ref = sp_kpool.kpool_topk(**inputs, seq=seq1, config=config)
        toks = replay.documents(ref, seq1)
        pools = replay.documents(ref, seq1, as_pools=True, kpool=config.kpool)
        out[f"replay/{cname}/documents/tokens"] = _sha(torch.cat([t.flatten() for t in toks]))
        out[f"replay/{cname}/documents/pools"] = _sha(torch.cat([t.flatten() for t in pools]))
        for ids, caps in (("tokens", toks), ("pools", pools)):
            got = replay.shard(caps, seq1, config, ids=ids, missing="fail")
            out[f"replay/{cname}/shard/{ids}/w1"] = _sha(got)
            for ws in (2, 3, 4):
                for layout in ("contiguous", "zigzag", "zigzag-per-document", "positions"):
                    if layout == "positions":
                        seqs = layout_seqs(x.cu_seq_lens, ws, rank_positions=random_rank_positions(cu[-1], ws, ws))
                    else:
                        seqs = layout_seqs(x.cu_seq_lens, ws, layout)
                    parts = [replay.shard_local(caps, s, config, ids=ids, missing="fail") for s in seqs]
                    out[f"replay/{cname}/shard_local/{ids}/w{ws}/{layout}"] = _sha(torch.cat([p[0] for p in parts]))
        # uncovered rows: the last three of each document (tokens) and the last two (pools)
        short = [t[: max(0, t.shape[0] - 3)] for t in toks]
        short_pools = [t[: max(0, t.shape[0] - 2)] for t in pools]
        for ids, caps in (("tokens", short), ("pools", short_pools)):
            out[f"replay/{cname}/uncovered/{ids}/compute"] = _sha(
                replay.shard(caps, seq1, config, ids=ids, missing="compute", inputs=inputs))
            out[f"replay/{cname}/uncovered/{ids}/compute-callable"] = _sha(
                replay.shard(caps, seq1, config, ids=ids, inputs=lambda: tuple(inputs[n] for n in replay.INPUTS)))
            empty = replay.shard(caps, seq1, config, ids=ids, missing="empty")
            out[f"replay/{cname}/uncovered/{ids}/empty"] = _sha(empty)
            for ws in (2, 3):
                for s in layout_seqs(x.cu_seq_lens, ws, "zigzag"):
                    got, uncovered = replay.shard_local(caps, s, config, ids=ids, missing="empty")
                    out[f"replay/{cname}/uncovered/{ids}/shard_local/w{ws}/rank{s.rank}"] = _sha(got)
                    out[f"replay/{cname}/uncovered/{ids}/shard_local/w{ws}/rank{s.rank}/rows"] = _sha(uncovered)
        # compare: a perturbed capture against the computed selection
        bad = replay.shard(_perturbed(toks, config.kpool, config.topk), seq1, config, missing="fail")
        out[f"replay/{cname}/compare/same"] = _json_sha(replay.compare(ref, ref, seq1))
        out[f"replay/{cname}/compare/perturbed"] = _json_sha(replay.compare(bad, ref, seq1))
        P = sum(n // config.kpool for n in REPLAY_LENGTHS)
        scores = torch.randn(seq1.shard_size, P, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        out[f"replay/{cname}/compare/scores"] = _json_sha(replay.compare(bad, ref, seq1, scores=scores,
                                                                          kpool=config.kpool, rel_tol=0.5))
        sample = replay.sample_rows(seq1, 0.5, 3)
        out[f"replay/{cname}/sample_rows"] = _sha(sample)
        out[f"replay/{cname}/compare/sample"] = _json_sha(replay.compare(bad, ref, seq1, rows=sample))
    # KPoolIndexer's replay and verify modes (rows not covered computed; a perturbed capture)
    seq = sp_kpool.ShardedSequence.split(cu, 1, 0)
    g = torch.Generator().manual_seed(1)
    hidden, q_resid = torch.randn(seq.shard_size, 32, generator=g), torch.randn(seq.shard_size, 16, generator=g)

    def indexer(**kw):
        torch.manual_seed(0)
        m = sp_kpool.KPoolIndexer(hidden_size=32, q_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=16,
                                  index_kpool=4, precision="bf16", dtype=torch.float32, **kw)
        for p in m.parameters():
            p.data.normal_()
        return m

    computed = indexer()(hidden, q_resid, seq)
    capture = [t[:-1] for t in replay.documents(computed, seq)]
    perturbed = _perturbed(capture, 4, 16)
    out["replay/indexer/replay"] = _sha(indexer(mode="replay")(hidden, q_resid, seq, replay=capture))
    out["replay/indexer/replay-empty"] = _sha(indexer(mode="replay", replay_missing="empty")(hidden, q_resid, seq,
                                                                                          replay=capture))
    for rows in (1.0, 0.25):
        verify = indexer(mode="verify", verify_rows=rows, verify_seed=4)
        for name, cap in (("same", capture), ("perturbed", perturbed)):
            out[f"replay/indexer/verify/{rows}/{name}"] = _sha(verify(hidden, q_resid, seq, replay=cap))
            out[f"replay/indexer/verify/{rows}/{name}/report"] = _json_sha(verify.last_comparison)


# --------------------------------------------------------------------------- Triton kernels (child process)


def _kernel_cases(out: dict) -> None:
    """The Triton kernels and the GPU backends' host code, run by Triton's CPU interpreter.
    Runs in a child process started with ``TRITON_INTERPRET=1`` (:func:`_kernels`)."""
    from sp_kpool import selectors
    from sp_kpool.pooling import pool_table
    from sp_kpool.testing.triton_interp import interpreted_module

    tk = interpreted_module("sp_kpool.kernels.triton_topk")
    ff = interpreted_module("sp_kpool.kernels.triton_fp8_fused")
    ts = interpreted_module("sp_kpool.kernels.triton_serving")

    # the exact Top-K selector: random rows and ranges, ties, -0.0 and -inf, tiny rows, searches
    g = torch.Generator().manual_seed(0)
    s = torch.randn(6, 3000, generator=g)
    starts, ends = torch.tensor([0, 5, 100, 0, 2990, 3]), torch.tensor([3000, 2000, 100, 40, 3000, 2999])
    base = torch.arange(6, dtype=torch.int64) * 1000 + 7
    out["kernels/topk/random"] = _sha(tk.topk_ascending(s, starts, ends, base, 64, tile=512))
    for name, kw in (("ways2", dict(ways=2)), ("capg512", dict(capg=512)), ("ways5-w8", dict(ways=5, num_warps=8)),
                     ("vsteps0", dict(vsteps=0)), ("short-all", dict(short_rows="all"))):
        out[f"kernels/topk/{name}"] = _sha(tk.topk_ascending(s, starts, ends, base, 64, tile=512, **kw))
    t = torch.randint(-3, 4, (5, 3000), generator=g).float()
    t[1] = 0.0
    t[2, ::2] = -0.0
    t[3, ::3] = -float("inf")
    t[4, 100:2500] = 3.0
    t[0, ::7] = float("nan")
    st, en = torch.tensor([0, 5, 0, 0, 1]), torch.tensor([3000, 2000, 3000, 2999, 3000])
    out["kernels/topk/ties"] = _sha(tk.topk_ascending(t, st, en, base[:5], 64, tile=512))
    out["kernels/topk/ties-k300"] = _sha(tk.topk_ascending(t, st, en, base[:5], 300, tile=1024, capg=512))
    tiny = torch.randn(2, 40, generator=g)
    for k in (1, 16):
        out[f"kernels/topk/tiny/k{k}"] = _sha(tk.topk_ascending(tiny, torch.tensor([0, 3]), torch.tensor([40, 39]),
                                                                base[:2], k, tile=16))
    out["kernels/topk/supports"] = _json_sha([tk.supports(w, k) for w in (100, 70000, 140000) for k in (16, 2048)])

    # the fused FP8 / BF16 scorer and selector
    def fp8_case(C, H, P, seed):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(C, H, 128, generator=g)
        kv = torch.randn(P, 128, generator=g)
        w = torch.randn(C, H, generator=g).abs() * 0.1
        scale = 2.0 ** torch.randint(-3, 3, (P,), generator=g).float()
        return q.to(torch.float8_e4m3fn), w, kv.to(torch.float8_e4m3fn), scale

    starts = torch.tensor([0, 3, 100, 650, 0, 5, 699], dtype=torch.int32)
    ends = torch.tensor([700, 690, 100, 700, 10, 17, 700], dtype=torch.int32)
    for H, bq, one_dot in ((32, 4, True), (32, 4, False), (64, 2, True), (128, 1, True)):
        q8, w, k8, scale = fp8_case(7, H, 700, seed=H + bq)
        name = f"kernels/fused/fp8/H{H}/bq{bq}/one_dot{one_dot}"
        dense = ff.score_select(q8, w, k8, scale, starts, ends, 16, dense=True, block_q=bq, one_dot=one_dot)
        out[f"{name}/dense"] = _sha(dense)
        ids, emitted = ff.score_select(q8, w, k8, scale, starts, ends, 16, pool_base=5, block_q=bq, one_dot=one_dot,
                                       check=2)
        out[f"{name}/select"] = _sha(ids)
        out[f"{name}/emitted"] = _sha(emitted)
        other = "atomic" if ff.SLOTS == "scan" else "scan"
        ids2, emitted2 = ff.score_select(q8, w, k8, scale, starts, ends, 16, pool_base=5, block_q=bq, one_dot=one_dot,
                                         check=2, slots=other)
        out[f"{name}/select-{other}"] = _sha(torch.cat([ids2.flatten(), emitted2.flatten().int()]))
    q8, w, k8, scale = fp8_case(7, 32, 700, seed=35)
    q, keys = q8.float().bfloat16(), k8.float().bfloat16()
    out["kernels/fused/bf16/H32/dense"] = _sha(ff.score_select(q, w, keys, None, starts, ends, 16, dense=True))
    out["kernels/fused/bf16/H32/select"] = _sha(ff.score_select(q, w, keys, None, starts, ends, 16, check=2)[0])
    g = torch.Generator().manual_seed(64)
    q8, w, k8, scale = fp8_case(13, 64, 300, seed=66)
    st = torch.randint(0, 150, (13,), generator=g, dtype=torch.int32)
    en = torch.clamp(st + torch.randint(0, 200, (13,), generator=g, dtype=torch.int32), max=300)
    en[3] = st[3]
    out["kernels/fused/fp8/H64/pairs"] = _sha(ff.score_select(q8, w, k8, scale, st, en, 1, dense=True, block_q=2,
                                                             rows=(2, 11), pairs=True))
    out["kernels/fused/fp8/H64/probe"] = _sha(ff.scores_probe(q8, w, k8, scale, st, en))
    limits = [ff.capacity(k) for k in (16, 512, 2048)]
    limits += [ff.supports(h, d, k) for h in (32, 48) for d in (128, 64) for k in (16, 4096)]
    out["kernels/fused/capacity"] = _json_sha(limits)

    # the serving kernels: pools (BF16 / FP8, with and without an extend mask), queries, both at once, model pools
    g = torch.Generator().manual_seed(11)
    S, D, K = 3 + 36 * 4, 128, 4
    kx, gx, ape = torch.randn(S, D, generator=g), torch.randn(S, D, generator=g), torch.randn(K, D, generator=g)
    pstart = torch.arange(3, S, K, dtype=torch.int64)
    extend = torch.rand(36, generator=g) < 0.5
    for fp8 in (False, True):
        for ext_name, ext in (("decode", None), ("mixed", extend)):
            res = ts.pools_serving(kx, gx, ape, pstart, fp8=fp8, extend=ext)
            res = res if fp8 else (res,)
            out[f"kernels/serving/pools/fp8{fp8}/{ext_name}"] = _bytes_sha(*res)
    for H, D_ in ((16, 64), (32, 128)):
        qq, ww = torch.randn(5, H, D_, generator=g), torch.randn(5, H, generator=g)
        q8o, wo = ts.queries_fp8(qq, ww, before=1, after=2)
        out[f"kernels/serving/queries/H{H}/D{D_}"] = _bytes_sha(q8o, wo)
    qq, ww = torch.randn(3, 2, 128, generator=g), torch.randn(3, 2, generator=g)
    for ext_name, ext in (("decode", None), ("mixed", extend)):
        (k8o, kso), (q8o, wo) = ts.prepare_fp8(qq, ww, kx, gx, ape, pstart, before=1, after=2, extend=ext)
        out[f"kernels/serving/prepare_fp8/{ext_name}"] = _bytes_sha(k8o, kso, q8o, wo)
    for S_, D_, K_, gdt in ((4 * 37 + 5, 128, 4, torch.bfloat16), (211, 64, 1, torch.float32),
                            (16 * 60 + 3, 128, 16, torch.bfloat16)):
        g = torch.Generator().manual_seed(S_)
        km = torch.randn(S_, D_, generator=g).bfloat16()
        gm = (torch.randn(S_, D_, generator=g) * 3).to(gdt)
        am = torch.randn(K_, D_, generator=g).bfloat16()
        pst = pool_table(torch.tensor([0, S_ // 3 + 1, S_ // 2, S_]), K_)[0]
        out[f"kernels/serving/pools_model/S{S_}/D{D_}/K{K_}"] = _sha(ts.pools_model(km, gm, am, pst).view(torch.int16))
    supported = [ts.pools_model_supports(k, d) for k in (1, 4, 16, 32) for d in (64, 128)]
    out["kernels/serving/pools_model_supports"] = _json_sha(supported)

    # the selector registry and the GPU backends with the stand-ins (the Triton selector, the fused selector)
    out["selectors/describe/cpu"] = _json_sha(selectors.describe(torch.device("cpu")))
    out["selectors/short_rows_hint"] = _json_sha([selectors.short_rows_hint([0, 19, 20, 32, 41], a, b, 8, 4)
                                                 for a, b in ((0, 41), (19, 32), (30, 41))])
    _standin_backends(out)


def _standin_backends(out: dict) -> None:
    import dataclasses

    import pytest

    from sp_kpool.testing import standins

    lengths, K, topk = [19, 1, 12, 9], 4, 8
    cases = [("triton", "bf16", 32, 1, "fixed", "ascending", True, False),
             ("triton", "bf16-serving", 32, 3, "compact", "score", True, False),
             ("triton", "bf16", 64, 3, "fixed", "score", False, False),
             ("triton", "bf16", 32, 3, "fixed", "ascending", True, True),
             ("deepgemm", "fp8", 32, 2, "fixed", "ascending", True, False),
             ("deepgemm", "fp8", 64, 3, "compact", "score", False, False)]
    for backend, precision, heads, world, tail, order, selector, fused in cases:
        x = make_inputs(lengths, heads=heads, head_dim=128, kpool=K, seed=heads + world, dtype=torch.bfloat16)
        with pytest.MonkeyPatch.context() as mp:
            settings = standins.install(mp, triton_selector=selector).settings
            if fused:
                settings = dataclasses.replace(settings, fused=True)
            budget = 7 * 9 * 4 if backend == "triton" else 2 * 5120  # chunks of 7 rows (triton), 8 (deepgemm)
            ids = simulate_ranks(x, world, topk=topk, kpool=K, backend=backend, precision=precision, tail=tail,
                                 order=order, max_logits_bytes=budget, settings=settings)
        name = f"backends/{backend}/{precision}/H{heads}/w{world}/{tail}/{order}/selector{selector}/fused{fused}"
        out[name] = _sha(torch.cat(ids))


def _kernels(path: str) -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("_kernels: run with TRITON_INTERPRET=1 (write starts it so)")
    torch.set_num_threads(1)
    out: dict[str, str] = {}
    _kernel_cases(out)
    with open(path, "w") as f:
        json.dump(out, f)
    return 0


def _interpreted(out: dict) -> None:
    """:func:`_kernel_cases` in a child process with ``TRITON_INTERPRET=1``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernels.json")
        env = dict(os.environ, TRITON_INTERPRET="1")
        env.pop("SP_KPOOL_MQA_LAYOUT", None)
        env.pop("SP_KPOOL_MAX_LOGITS_BYTES", None)
        subprocess.run([sys.executable, os.path.abspath(__file__), "_kernels", path], env=env, check=True)
        with open(path) as f:
            out.update(json.load(f))


def write(path: str) -> int:
    out: dict[str, str] = {}
    for part in (_simulated, _indexer, _parity, _replay, _interpreted, _distributed):
        part(out)
        print(f"[output_digest] {part.__name__.strip('_')}: {len(out)} cases so far", flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    print(f"[output_digest] wrote {len(out)} digests to {path}")
    return 0


def compare(a: str, b: str) -> int:
    with open(a) as f:
        da = json.load(f)
    with open(b) as f:
        db = json.load(f)
    bad = sorted(k for k in set(da) | set(db) if da.get(k) != db.get(k))
    for k in bad:
        print(f"DIFFERS: {k}: {da.get(k, 'missing')} vs {db.get(k, 'missing')}")
    print(f"{len(set(da) | set(db)) - len(bad)} equal, {len(bad)} differ")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("path")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    k = sub.add_parser("_kernels")  # internal: write's interpreted cases, in a child with TRITON_INTERPRET=1
    k.add_argument("path")
    args = ap.parse_args(argv)
    if args.cmd == "_kernels":
        return _kernels(args.path)
    return write(args.path) if args.cmd == "write" else compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
