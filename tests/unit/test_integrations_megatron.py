"""``sp_kpool.integrations.megatron`` against Megatron-LM's own layout code.

Megatron's functions come from the megatron-core wheel (``tests/unit/megatron_ref.py``:
``dsa_layout.py`` of ``experimental_attention_variant``, ``get_batch_on_this_cp_rank`` and the
``PackedSeqParams`` dataclass), compared with:

* ``build_packed_allgather_cp_local_positions`` (packed THD, ``cu_seqlens_cover_output`` both
  ways) and ``build_packed_allgather_cp_query_positions_and_key_reorder`` (the gathered-K/V
  reorder ``DSAttention.forward`` applies);
* ``build_zigzag_cp_local_positions``, ``get_batch_on_this_cp_rank`` and
  ``build_zigzag_allgather_cp_key_reorder`` (non-packed).

``cu_seqlens_q_padded`` is built as Megatron's data pipeline does: every sequence rounded up to
a multiple of ``2 * cp_size`` (or of a larger multiple, or by any multiple of it per sequence).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from megatron_ref import megatron, megatron_cp_batch_split, packed_seq_params_class, sort_topk_by_index

from sp_kpool import ShardedSequence, kpool_topk
from sp_kpool.integrations.megatron import gathered_ids, key_reorder, sharded_sequence
from sp_kpool.testing.dist import run_ranks
from sp_kpool.testing.problems import make_inputs, shard_inputs

CPU = torch.device("cpu")
CASES = [[1], [7], [16], [0, 5], [3, 0, 0, 9], [1, 1, 1, 1, 1], [2, 3, 5, 7, 11, 13], [15, 1, 16, 31], [100, 1, 0, 17]]


def _cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def _params(lengths, multiple, extra=None):
    """Megatron's PackedSeqParams (from the wheel) for ``lengths`` padded to ``multiple``; ``extra``:
    per sequence, further multiples of it (pipelines that pad more)."""
    P = packed_seq_params_class()
    extra = extra or [0] * len(lengths)
    padded = [-(-n // multiple) * multiple + e * multiple for n, e in zip(lengths, extra)]
    cu, cu_pad = _cu(lengths), _cu(padded)
    return P(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
             cu_seqlens_kv_padded=cu_pad, max_seqlen_q=max(padded), max_seqlen_kv=max(padded))  # fmt: skip


@pytest.mark.parametrize("W", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("lengths", CASES, ids=lambda c: "-".join(map(str, c)))
def test_packed_positions_and_reorder_equal_megatrons(lengths, W):
    dsa, _ = megatron()
    rnd = random.Random(len(lengths) * 10 + W)
    for multiple, extra in ((2 * W, None), (6 * W, None), (2 * W, [rnd.randrange(3) for _ in lengths])):
        p = _params(lengths, multiple, extra)
        for r in range(W):
            seq = sharded_sequence(p, world_size=W, rank=r)
            ref = dsa.build_packed_allgather_cp_local_positions(p.cu_seqlens_q_padded, W, r, CPU,
                                                                cu_seqlens_cover_output=True)  # fmt: skip
            assert torch.equal(seq.positions, ref), (lengths, W, multiple, extra, r, seq.positions.tolist(), ref.tolist())
        # the stream is the padded THD stream: its real tokens are cu_seqlens_q's, shifted
        real = seq.real_of_stream
        for d, (a, b) in enumerate(zip(p.cu_seqlens_q_padded.tolist(), p.cu_seqlens_q_padded.tolist()[1:])):
            n = int(p.cu_seqlens_q[d + 1] - p.cu_seqlens_q[d])
            assert real[a : a + n].tolist() == list(range(int(p.cu_seqlens_q[d]), int(p.cu_seqlens_q[d]) + n))
            assert (real[a + n : b] == -1).all()
        _, reorder = dsa.build_packed_allgather_cp_query_positions_and_key_reorder(
            p.cu_seqlens_q_padded, p.cu_seqlens_kv_padded, W, 0, CPU,
            query_cu_seqlens_cover_output=True, key_cu_seqlens_cover_output=True)  # fmt: skip
        assert torch.equal(key_reorder(seq), reorder)


@pytest.mark.parametrize("W", [2, 4])
def test_trailing_rows_beyond_cu_seqlens_match_megatrons_reorder(W):
    # local THD tensors longer than cu_seqlens_q_padded[-1] / cp_size: Megatron places the extra
    # rows after every real token (cu_seqlens_cover_output=False); the reorder agrees
    dsa, _ = megatron()
    p = _params([5, 9], 2 * W)
    local = int(p.cu_seqlens_q_padded[-1]) // W + 3
    for r in range(W):
        seq = sharded_sequence(p, world_size=W, rank=r, local_rows=local)
        assert seq.shard_size == local
        ref = dsa.build_packed_allgather_cp_local_positions(p.cu_seqlens_q_padded, W, r, CPU, output_size=local)
        n = local - 3
        assert torch.equal(seq.positions[:n], ref[:n])  # the real rows: the same positions
    _, reorder = dsa.build_packed_allgather_cp_query_positions_and_key_reorder(
        p.cu_seqlens_q_padded, p.cu_seqlens_kv_padded, W, 0, CPU, local_output_size=local)
    assert torch.equal(key_reorder(seq), reorder)


@pytest.mark.parametrize("W", [1, 2, 3, 4])
@pytest.mark.parametrize("seq_len", [24, 48, 120])
def test_nonpacked_zigzag_equals_megatrons(seq_len, W):
    dsa, split = megatron()
    for r in range(W):
        seq = sharded_sequence(None, world_size=W, rank=r, seq_len=seq_len)
        assert torch.equal(seq.positions, dsa.build_zigzag_cp_local_positions(seq_len, W, r, CPU))
        assert torch.equal(seq.positions, megatron_cp_batch_split(split, torch.arange(seq_len), W, r))
        assert seq.num_padding == 0
    assert torch.equal(key_reorder(seq), dsa.build_zigzag_allgather_cp_key_reorder(seq_len // W, W, CPU))


def test_ids_index_megatrons_reordered_gathered_kv():
    # simulate DSAttention.forward: every rank's local K rows, all-gathered in rank order, then
    # index_select(kv_reorder_idx); our ids index the result; gathered_ids index the raw gather
    dsa, _ = megatron()
    W = 4
    p = _params([7, 1, 12], 2 * W)
    seqs = [sharded_sequence(p, world_size=W, rank=r) for r in range(W)]
    total = int(p.cu_seqlens_q_padded[-1])
    stream_k = torch.arange(total) * 10  # a K whose row t says "stream position t"
    gathered = torch.cat([stream_k[s.positions] for s in seqs])  # rank 0's rows, rank 1's, ...
    _, reorder = dsa.build_packed_allgather_cp_query_positions_and_key_reorder(
        p.cu_seqlens_q_padded, p.cu_seqlens_kv_padded, W, 0, CPU,
        query_cu_seqlens_cover_output=True, key_cu_seqlens_cover_output=True)  # fmt: skip
    reordered = gathered.index_select(0, reorder)
    assert torch.equal(reordered, stream_k)  # reordered K is in stream order: ids index it directly
    ids = torch.tensor([[0, 5, -1], [total - 1, 8, 3]], dtype=torch.int32)
    g = gathered_ids(seqs[0], ids)
    assert g.dtype == torch.int32 and (g[ids < 0] == -1).all()
    assert torch.equal(gathered[g[ids >= 0].long()], stream_k[ids[ids >= 0].long()])


def test_column_order_is_megatrons_canonical_attention_order():
    # Megatron's cuDNN/FlashMLA DSA path compacts and sorts the top-k ids by index
    # (_prepare_attention_topk_indices -> dsa_masking.sort_topk_by_index) before its sparse
    # attention; order="ascending", tail="compact" is already that layout (the tail ids come
    # after every pool of the row), so its preparation leaves our ids unchanged. The default
    # (tail="fixed") and order="score" are the same sets: Megatron canonicalizes them to it.
    canon = sort_topk_by_index()
    x = make_inputs([37, 64, 9], heads=4, head_dim=8, kpool=4, seed=2)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=1, rank=0)
    run = lambda **kw: kpool_topk(**shard_inputs(x, seq), seq=seq, topk=32, kpool=4, **kw)  # noqa: E731
    ours = run(order="ascending", tail="compact")
    S = int(x.cu_seq_lens[-1])
    mc = lambda ids: canon(ids.long(), ids >= 0, sk=S)[0].int()  # noqa: E731
    assert torch.equal(mc(ours), ours)
    for other in (run(), run(order="score"), run(order="score", tail="compact")):
        assert not torch.equal(other, ours) and torch.equal(mc(other), ours)


@pytest.mark.parametrize("kwargs, text", [
    (dict(lengths=[5, 7], multiple=3), "PackedSeqParams.cu_seqlens_q_padded: sequence 0 is padded to 6 tokens, "
                                       "not a multiple of 2 * cp_size = 4"),
    (dict(lengths=[5, 7], multiple=1), "PackedSeqParams.cu_seqlens_q_padded: sequence 0 is padded to 5 tokens"),
])  # fmt: skip
def test_padding_not_a_multiple_of_2w_names_the_field(kwargs, text):
    p = _params(kwargs["lengths"], kwargs["multiple"])
    with pytest.raises(ValueError) as err:
        sharded_sequence(p, world_size=2, rank=0)
    assert text in str(err.value), str(err.value)


def test_bad_params_name_megatrons_fields():
    P = packed_seq_params_class()
    cu = _cu([4, 4])
    with pytest.raises(ValueError, match=r"PackedSeqParams\.cu_seqlens_q: expected the real|cu_seqlens_q: required"):
        sharded_sequence(P(qkv_format="thd", cu_seqlens_q_padded=cu), world_size=2, rank=0)
    with pytest.raises(ValueError, match=r"PackedSeqParams\.qkv_format: expected 'thd'"):
        sharded_sequence(P(qkv_format="sbhd", cu_seqlens_q=cu), world_size=2, rank=0)
    with pytest.raises(ValueError, match=r"PackedSeqParams\.cu_seqlens_q_padded: sequence 1 is padded to 2 tokens, "
                                         r"fewer than its 4 real tokens"):  # fmt: skip
        sharded_sequence(P(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=_cu([4, 2])), world_size=1)
    with pytest.raises(ValueError, match=r"PackedSeqParams\.cu_seqlens_kv: expected the query's boundaries"):
        sharded_sequence(P(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=_cu([8])), world_size=2, rank=0)
    with pytest.raises(ValueError, match=r"PackedSeqParams\.cu_seqlens_q_padded: expected 3 entries"):
        sharded_sequence(P(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=_cu([8])), world_size=2, rank=0)
    with pytest.raises(ValueError, match=r"PackedSeqParams\.cu_seqlens_q: sequence 0 is padded to 4 tokens, not a "
                                         r"multiple of 2 \* cp_size = 8"):  # fmt: skip
        sharded_sequence(P(qkv_format="thd", cu_seqlens_q=cu), world_size=4, rank=0)  # no padded: q must be
    with pytest.raises(ValueError, match=r"seq_len: expected a multiple of 2 \* cp_size = 6"):
        sharded_sequence(None, world_size=3, rank=0, seq_len=20)
    with pytest.raises(ValueError, match=r"seq_len: required"):
        sharded_sequence(None, world_size=3, rank=0)
    with pytest.raises(ValueError, match=r"rank: expected 0 <= rank < world_size = 2"):
        sharded_sequence(None, world_size=2, rank=2, seq_len=8)
    with pytest.raises(ValueError, match=r"cp_group: a process group was given but torch.distributed is not"):
        sharded_sequence(None, object(), seq_len=8)


# --- real ranks: the CP group, the gather, every rank against world size 1 ------------------


def _inputs(total, H=4, D=8, K=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(total, H, D, generator=g), torch.randn(total, D, generator=g),
            torch.randn(total, D, generator=g), torch.randn(total, H, generator=g), torch.randn(K, D, generator=g))  # fmt: skip


RANK_CASES = [([5, 9], 8), ([1, 13, 0, 22], 8), ([31], 12), ([3, 3, 3], 4)]


def _ranks_case(rank, world_size, params):
    import torch.distributed as dist

    torch.set_num_threads(1)
    group = dist.new_group(list(range(world_size)))  # a CP group (here: all ranks)
    report = []
    for lengths, topk in RANK_CASES:
        p = SimpleNamespace(**params[str(lengths)])  # PackedSeqParams' fields (its class is the wheel's, not picklable)
        seq = sharded_sequence(p, group)
        world1 = sharded_sequence(p, world_size=1)  # the same padded stream, one rank
        q, k, g, w, ape = _inputs(world1.total_length, seed=len(lengths))  # rows in stream order
        pos = seq.positions
        ids = kpool_topk(q[pos], k[pos], g[pos], w[pos], ape, seq, topk=topk, kpool=4)
        ref = kpool_topk(q, k, g, w, ape, world1, topk=topk, kpool=4)
        report.append((str(lengths), torch.equal(ids, ref[pos]), bool((ids >= 0).any())))
    # non-packed zigzag
    seq = sharded_sequence(None, group, seq_len=8 * world_size)
    world1 = sharded_sequence(None, seq_len=8 * world_size)
    q, k, g, w, ape = _inputs(8 * world_size, seed=99)
    pos = seq.positions
    ids = kpool_topk(q[pos], k[pos], g[pos], w[pos], ape, seq, topk=8, kpool=4)
    ref = kpool_topk(q, k, g, w, ape, world1, topk=8, kpool=4)
    report.append(("non-packed", torch.equal(ids, ref[pos]), True))
    return report


@pytest.mark.xdist_group("ranks")
@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_equal_world_size_one(world_size):
    params = {str(lengths): dict(vars(_params(lengths, 2 * world_size))) for lengths, _ in RANK_CASES}
    results = run_ranks(_ranks_case, world_size, (params,), timeout=240)
    for rank, report in enumerate(results):
        for name, equal, _ in report:
            assert equal, (world_size, rank, name)
