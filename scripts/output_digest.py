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
  scores and Top-K statistics, timings and paths left out).

``compare`` prints each case that differs and exits 1 if any does. Runs with the package
installed (``pip install -e .``); takes about a minute on two cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile

import torch

import sp_kpool
from sp_kpool.parity import make_synthetic_capture, replay
from sp_kpool.testing.dist import run_ranks
from sp_kpool.testing.problems import (
    make_inputs,
    random_doc_lengths,
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


def write(path: str) -> int:
    out: dict[str, str] = {}
    for part in (_simulated, _indexer, _parity, _distributed):
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
    args = ap.parse_args(argv)
    return write(args.path) if args.cmd == "write" else compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
