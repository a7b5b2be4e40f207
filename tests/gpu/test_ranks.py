"""Every rank of a 2/3/4/8-rank split, computed in this process (the gather replaced by the
padded global keys), equals world size 1 bit for bit, per GPU backend arm (gpu_check
section ``ranks``; ``-k tilelang`` / ``-k triton`` / ``-k deepgemm`` runs one backend, as
its ``--ranks-backends`` did)."""

import dataclasses

import pytest
import torch

from sp_kpool.sharding import ShardedSequence
from sp_kpool.testing.gpu_checks import ids_of
from sp_kpool.testing.problems import rank_slice_problem

pytestmark = pytest.mark.xdist_group("gpu")
LENGTHS = [3001, 1, 2, 5000, 4095]
NEEDS = {"tilelang": ("tilelang",), "deepgemm": ("deep_gemm", "triton"), "triton": ("triton",)}
ARMS = [pytest.param(name, precision, H, D, marks=pytest.mark.requires(*NEEDS[name]), id=f"{name}-{precision}-H{H}")
        for name, precision, H, D in (("tilelang", "bf16", 64, 128), ("tilelang", "bf16-serving", 32, 128),
                                      ("triton", "bf16", 32, 128), ("triton", "bf16-serving", 64, 128),
                                      ("deepgemm", "fp8", 64, 128), ("deepgemm", "fp8", 32, 128))]  # fmt: skip


def _world_size_one(cache, name, precision, H, D):
    """``(problem, ids)`` of the whole sequence at world size 1 for this arm (cached)."""
    key = (name, precision, H, D)
    if key not in cache:
        base = rank_slice_problem(sum(LENGTHS), 1, 0, heads=H, head_dim=D, topk=2048, lengths=LENGTHS,
                                  precision=precision, max_logits_bytes=64 << 20, seed=11)  # fmt: skip
        cache[key] = base, ids_of(name, base)
    return cache[key]


def _padrows(t, n):
    return torch.cat([t, t.new_zeros((n, *t.shape[1:]))]) if n > 0 else t


@pytest.mark.parametrize("ws", (2, 3, 4, 8))
@pytest.mark.parametrize("name,precision,H,D", ARMS)
def test_every_rank_equals_world_size_one(cache, name, precision, H, D, ws):
    base, ref = _world_size_one(cache, name, precision, H, D)
    wrong = []
    for r in range(ws):
        seq = ShardedSequence.split(base.seq.cu_seq_lens, world_size=ws, rank=r)
        pad = seq.total_length - base.k.shape[0]
        a, b = seq.shard_start, min(seq.shard_end, seq.num_real_tokens)
        q = _padrows(base.q[a:b], seq.shard_size - max(0, b - a))
        w = _padrows(base.head_weights[a:b], seq.shard_size - max(0, b - a))
        p = dataclasses.replace(base, seq=seq, q=q, head_weights=w, k=_padrows(base.k, pad), gates=_padrows(base.gates, pad))
        out = ids_of(name, p)
        n = max(0, b - a)
        if not (torch.equal(out[:n], ref[a:b]) and bool((out[n:] == -1).all())):
            wrong.append(r)
    assert not wrong, f"ranks differing from world size 1: {wrong} of {ws}"


@pytest.mark.parametrize("ws", (2, 4))
@pytest.mark.parametrize("layout", ("zigzag", "zigzag-per-document", "positions"))
@pytest.mark.parametrize("name,precision,H,D", ARMS)
def test_every_layout_equals_world_size_one(cache, name, precision, H, D, layout, ws):
    """The layouts on the GPU backends: each rank's rows (storage order, stream ids) mapped
    to real rows equal the world-size-1 rows bit for bit; padding rows are all -1."""
    from sp_kpool.testing.problems import layout_seqs, random_rank_positions

    base, ref = _world_size_one(cache, name, precision, H, D)
    if layout == "positions":
        positions = random_rank_positions(base.seq.num_real_tokens, ws, seed=ws)
        seqs = layout_seqs(base.seq.cu_seq_lens, ws, rank_positions=positions)
    else:
        seqs = layout_seqs(base.seq.cu_seq_lens, ws, layout)
    wrong = []
    for seq in seqs:
        real = seq.real_of_stream[seq.positions].to(base.q.device)
        keep = real >= 0

        def rows(t):
            return torch.where(keep.view(-1, *([1] * (t.dim() - 1))), t[real.clamp(min=0)], torch.zeros_like(t[:1]))

        p = dataclasses.replace(base, seq=seq, q=rows(base.q), head_weights=rows(base.head_weights))
        out = ids_of(name, p)  # k, gates: the real rows of the whole sequence (what the gather gives)
        got = seq.real_ids(out)
        if not (torch.equal(got[keep], ref[real[keep]]) and bool((out[~keep] == -1).all())):
            wrong.append(seq.rank)
    assert not wrong, f"ranks differing from world size 1 ({layout}): {wrong} of {ws}"
