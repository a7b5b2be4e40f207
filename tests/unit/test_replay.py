"""Replay of rollout selections (sp_kpool.replay): every layout, simulated and gloo ranks,
validation errors, missing rows, compare."""

import json

import numpy as np
import pytest
import torch

from sp_kpool import KPoolConfig, ShardedSequence, kpool_topk, replay
from sp_kpool.testing.dist import run_ranks
from sp_kpool.testing.problems import layout_seqs, make_inputs, random_rank_positions, shard_inputs, simulate_ranks

LENGTHS = [37, 5, 64, 1, 22]
K, TOPK = 4, 16


def _problem(lengths=LENGTHS, seed=0, kpool=K):
    return make_inputs(lengths, heads=8, head_dim=16, kpool=kpool, seed=seed)


def _world1(x, config):
    seq = ShardedSequence.split(x.cu_seq_lens, 1, 0)
    return kpool_topk(**shard_inputs(x, seq), seq=seq, config=config), seq


def _seqs(cu, world_size, layout, seed=0):
    if layout == "positions":
        return layout_seqs(cu, world_size, rank_positions=random_rank_positions(cu[-1], world_size, seed))
    return layout_seqs(cu, world_size, layout)


CONFIGS = [
    KPoolConfig(topk=TOPK, kpool=K),
    KPoolConfig(topk=TOPK, kpool=K, tail="compact", order="score", alignment=8),
    KPoolConfig(topk=TOPK, kpool=K, tail="fixed", order="score"),
    KPoolConfig(topk=8, kpool=2, tail="compact", order="ascending", alignment=4),
]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "zigzag-per-document", "positions"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("as_pools", [False, True])
def test_replay_of_world_size_one_equals_kpool_topk_bit_for_bit(layout, world_size, as_pools):
    for config in CONFIGS:
        x = _problem(seed=world_size, kpool=config.kpool)
        ref, seq1 = _world1(x, config)
        caps = replay.documents(ref, seq1, as_pools=as_pools, kpool=config.kpool)
        seqs = _seqs(x.cu_seq_lens, world_size, layout, seed=world_size)
        outs = simulate_ranks(x, world_size, seqs=seqs, topk=config.topk, kpool=config.kpool, tail=config.tail,
                              order=config.order, alignment=config.alignment)  # fmt: skip
        for s, computed in zip(seqs, outs):
            got, uncovered = replay.shard_local(caps, s, config, ids="pools" if as_pools else "tokens", missing="fail")
            assert uncovered.numel() == 0
            assert got.dtype == torch.int32 and got.shape == computed.shape
            assert torch.equal(got, computed), f"{layout} rank {s.rank} of {world_size} {config}"


def test_numpy_captures_and_narrow_dtypes_replay_alike():
    x = _problem()
    config = CONFIGS[0]
    ref, seq1 = _world1(x, config)
    pools = replay.documents(ref, seq1, as_pools=True, kpool=K)
    for conv in (lambda t: t.numpy(), lambda t: t.to(torch.int16), lambda t: t.numpy().astype(np.int8),
                 lambda t: t.numpy().astype(">i4")):  # fmt: skip
        got = replay.shard([conv(p) for p in pools], seq1, config, ids="pools", missing="fail")
        assert torch.equal(got, ref)


def test_world_size_one_shard_with_its_agreement_equals_kpool_topk():
    for config in CONFIGS:
        x = _problem(kpool=config.kpool)
        ref, seq1 = _world1(x, config)
        got = replay.shard(replay.documents(ref, seq1), seq1, config, missing="fail")
        assert torch.equal(got, ref)
    got = replay.shard(replay.documents(ref, seq1), seq1, topk=config.topk, kpool=config.kpool, tail=config.tail,
                       order=config.order, alignment=config.alignment, missing="fail")  # the keyword form
    assert torch.equal(got, ref)


# --------------------------------------------------------------------------- rows not covered


def _truncated(caps, drop=1):
    return [c[: max(0, c.shape[0] - drop)] for c in caps]


def test_missing_rows_fail_names_document_and_row():
    x = _problem()
    ref, seq1 = _world1(x, CONFIGS[0])
    with pytest.raises(ValueError, match=r"captured: document 0, row 36: not covered by the capture \(captured\[0\] "
                                         r"has 36 rows, the document 37; missing='fail'\)"):  # fmt: skip
        replay.shard(_truncated(replay.documents(ref, seq1)), seq1, CONFIGS[0], missing="fail")


@pytest.mark.parametrize("config", CONFIGS[:2])
def test_missing_rows_empty_keep_the_tail_only(config):
    x = _problem()
    ref, seq1 = _world1(x, config)
    got = replay.shard(_truncated(replay.documents(ref, seq1)), seq1, config, missing="empty")
    cu = x.cu_seq_lens
    last = [cu[d + 1] - 1 for d in range(len(LENGTHS))]
    keep = torch.ones(ref.shape[0], dtype=torch.bool)
    keep[last] = False
    assert torch.equal(got[keep], ref[keep])
    for d, t in enumerate(last):
        j = t - cu[d]
        tail = list(range(t - (j + 1) % K + 1, t + 1))
        row = got[t]
        assert sorted(v for v in row.tolist() if v >= 0) == tail, (d, row)
        if config.tail == "fixed":
            assert row[: config.topk].eq(-1).all()


@pytest.mark.parametrize("config", CONFIGS[:2])
def test_missing_rows_compute_with_inputs_dict_or_callable(config):
    x = _problem()
    ref, seq1 = _world1(x, config)
    caps = _truncated(replay.documents(ref, seq1), drop=3)
    inputs = shard_inputs(x, seq1)
    assert torch.equal(replay.shard(caps, seq1, config, missing="compute", inputs=inputs), ref)
    calls = []
    assert torch.equal(replay.shard(caps, seq1, config, inputs=lambda: calls.append(1) or inputs), ref)
    assert calls == [1]
    full = replay.documents(ref, seq1)  # fully covered: the callable is never called
    assert torch.equal(replay.shard(full, seq1, config, inputs=lambda: calls.append(2) or inputs), ref)
    assert calls == [1]


def test_missing_rows_compute_exactly_the_uncovered_rows(monkeypatch):
    import sp_kpool.api

    config = CONFIGS[0]
    x = _problem()
    ref, seq1 = _world1(x, config)
    caps = _truncated(replay.documents(ref, seq1), drop=3)
    asked, real = [], sp_kpool.api.kpool_topk

    def spy(*args, rows=None, **kw):
        asked.append(rows)
        return real(*args, rows=rows, **kw)

    monkeypatch.setattr(sp_kpool.api, "kpool_topk", spy)
    assert torch.equal(replay.shard(caps, seq1, config, inputs=shard_inputs(x, seq1)), ref)
    cu = x.cu_seq_lens
    uncovered = sorted(t for d in range(len(LENGTHS)) for t in range(max(cu[d], cu[d + 1] - 3), cu[d + 1]))
    assert len(asked) == 1 and asked[0].tolist() == uncovered


# --------------------------------------------------------------------------- validation errors


def _caps():
    x = _problem()
    config = CONFIGS[0]
    ref, seq1 = _world1(x, config)
    return replay.documents(ref, seq1), replay.documents(ref, seq1, as_pools=True, kpool=K), seq1, config


def _set(caps, d, j, col, value):
    caps = [c.clone() for c in caps]
    caps[d][j, col] = value
    return caps


def test_every_validation_rule_names_document_row_column_value():
    toks, pools, seq, config = _caps()
    # document 2 (64 tokens), row 30: 7 visible pools, 4 selected (columns 0..15), tail 28..30 (16..18)
    assert toks[2][30, :16].tolist() != [-1] * 16
    cases = [
        (_set(toks, 2, 30, 3, -2), "tokens", "captured: document 2, row 30, column 3: value -2: expected a token "
                                             "position >= 0 (inside the document) or -1 (unused)"),
        (_set(toks, 2, 30, 3, 31), "tokens", "captured: document 2, row 30, column 3: value 31: after the row "
                                             "(not causal): expected a position <= 30"),
        # a causal violation alone: row 5 holds pool 0 (columns 0..3) and its tail 4, 5 (16, 17)
        (_set(toks, 2, 5, 4, 6), "tokens", "captured: document 2, row 5, column 4: value 6: after the row (not "
                                           "causal): expected a position <= 5"),
        (_set(toks, 2, 30, 3, 64), "tokens", "captured: document 2, row 30, column 3: value 64: outside document 2 "
                                             "of 64 tokens (expected a position <= 30, the row)"),
        (_set(toks, 2, 30, 5, int(toks[2][30, 4])), "tokens", "captured: document 2, row 30, column 5: value "
                                                              f"{int(toks[2][30, 4])}: selected twice in the row"),
        (_set(toks, 2, 30, 3, -1), "tokens", f"captured: document 2, row 30, column 0: value {int(toks[2][30, 0])}: "
                                             f"pool {int(toks[2][30, 0]) // 4} (positions"),
        (_set(pools, 2, 30, 1, 7), "pools", "captured: document 2, row 30, column 1: value 7: not causal: expected a "
                                            "complete pool ending at or before the row, pool ids < (j + 1) // K = 7 "
                                            "(document 2 has 16 pools)"),
        (_set(pools, 2, 30, 1, 16), "pools", "captured: document 2, row 30, column 1: value 16: outside the document"),
        (_set(pools, 2, 30, 1, -5), "pools", "captured: document 2, row 30, column 1: value -5: expected a pool id >= 0"),
        (_set(pools, 2, 30, 1, int(pools[2][30, 0])), "pools", "captured: document 2, row 30, column 1: value "
                                                               f"{int(pools[2][30, 0])}: selected twice in the row"),
    ]  # fmt: skip
    for caps, ids, text in cases:
        with pytest.raises(ValueError) as info:
            replay.shard(caps, seq, config, ids=ids, missing="fail")
        assert text in str(info.value), (text, str(info.value))
    # partial pools: the message names the pool and K
    with pytest.raises(ValueError, match=r"is not whole: history ids must come in whole pools of K = 4"):
        replay.shard(_set(toks, 2, 30, 3, -1), seq, config, missing="fail")
    # more pools than topk // K: a capture for another topk
    wide = [torch.cat([c, torch.full((c.shape[0], 4), -1, dtype=c.dtype)], 1) for c in pools]
    wide[2][30, 4] = next(p for p in range(7) if p not in pools[2][30].tolist())
    with pytest.raises(ValueError, match=r"captured: document 2, row 30, column \d: value \d+: more than topk // K = 4 "
                                         r"history pools in the row"):  # fmt: skip
        replay.shard(wide, seq, config, ids="pools", missing="fail")


def test_argument_errors_name_the_argument():
    toks, _, seq, config = _caps()
    with pytest.raises(ValueError, match=r"captured: expected 5 arrays \(one per real document of seq\), got 4"):
        replay.shard(toks[:4], seq, config, missing="fail")
    with pytest.raises(TypeError, match="captured: expected a list of"):
        replay.shard(toks[0], seq, config, missing="fail")
    with pytest.raises(ValueError, match=r"captured\[1\]: expected at most 5 rows \(the document's length\), got 6"):
        replay.shard([toks[0], torch.zeros(6, 3, dtype=torch.int32), *toks[2:]], seq, config, missing="fail")
    with pytest.raises(TypeError, match=r"captured\[0\]: expected an integer dtype, got torch.float32"):
        replay.shard([toks[0].float(), *toks[1:]], seq, config, missing="fail")
    with pytest.raises(ValueError, match=r"captured\[0\]: expected a 2-D array"):
        replay.shard([toks[0][0], *toks[1:]], seq, config, missing="fail")
    with pytest.raises(ValueError, match="ids: expected one of"):
        replay.shard(toks, seq, config, ids="positions", missing="fail")
    with pytest.raises(ValueError, match="missing: expected one of"):
        replay.shard(toks, seq, config, missing="skip")
    with pytest.raises(ValueError, match="inputs: missing='compute' needs the operator's inputs"):
        replay.shard(toks, seq, config)
    with pytest.raises(TypeError, match="seq: expected a ShardedSequence"):
        replay.shard(toks, None, config, missing="fail")


def test_an_error_in_a_later_chunk_is_found(monkeypatch):
    toks, _, seq, config = _caps()
    monkeypatch.setattr(replay, "_CHUNK_ENTRIES", 19 * 3)  # chunks of 3 rows
    assert torch.equal(replay.shard(toks, seq, config, missing="fail"), kpool_topk(
        **shard_inputs(_problem(), seq), seq=seq, config=config))  # fmt: skip
    with pytest.raises(ValueError, match="captured: document 4, row 20, column 0: value 21: after the row"):
        replay.shard(_set(toks, 4, 20, 0, 21), seq, config, missing="fail")


# --------------------------------------------------------------------------- compare


def test_compare_same_selection_full_agreement_and_json():
    x = _problem()
    config = CONFIGS[1]
    ref, seq1 = _world1(x, config)
    got = replay.shard(replay.documents(ref, seq1), seq1, config, missing="fail")
    rep = replay.compare(got, ref, seq1)
    assert json.loads(json.dumps(rep)) == rep
    assert rep["rows"] == sum(LENGTHS) and rep["rows_differing"] == 0 and rep["first_difference"] is None
    assert rep["jaccard_mean"] == 1.0 and rep["jaccard_min"] == 1.0
    # the column layout does not matter: sets are compared
    other, _ = _world1(x, CONFIGS[0])
    assert replay.compare(other, ref, seq1)["rows_differing"] == 0


def test_compare_reports_exactly_the_perturbed_rows():
    x = _problem()
    config = CONFIGS[0]
    ref, seq1 = _world1(x, config)
    toks = replay.documents(ref, seq1)
    # document 2, rows 40 and 50: swap a selected pool for an unselected visible one
    changed = []
    for j in (40, 50):
        row = toks[2][j]
        chosen = {int(v) // K for v in row[:TOPK] if v >= 0}
        free = next(p for p in range((j + 1) // K) if p not in chosen)
        drop = min(chosen)
        new = sorted((chosen - {drop}) | {free})
        toks[2][j, :TOPK] = torch.tensor([p * K + s for p in new for s in range(K)])
        changed.append((j, drop, free))
    got = replay.shard(toks, seq1, config, missing="fail")
    rep = replay.compare(got, ref, seq1)
    assert rep["rows_differing"] == 2
    assert rep["ids_only_replayed"] == rep["ids_only_computed"] == 2 * K
    # row 40: 4 pools and a tail of 1 id, one pool swapped: 13 common of 21 ids
    assert rep["jaccard_min"] == pytest.approx(13 / 21)
    first = rep["first_difference"]
    j, drop, free = changed[0]
    assert first["document"] == 2 and first["row"] == j and first["real_row"] == 42 + j
    assert first["stream_position"] == 42 + j and first["rank"] == 0
    assert first["only_replayed"] == [42 + free * K + s for s in range(K)]
    assert first["only_computed"] == [42 + drop * K + s for s in range(K)]


def test_compare_near_ties_with_scores():
    x = _problem()
    config = CONFIGS[0]
    ref, seq1 = _world1(x, config)
    toks = replay.documents(ref, seq1)
    P = sum(n // K for n in LENGTHS)
    scores = torch.zeros(sum(LENGTHS), P, dtype=torch.float64)
    row = toks[2][40]
    chosen = sorted({int(v) // K for v in row[:TOPK] if v >= 0})
    free = next(p for p in range(41 // K) if p not in chosen)
    toks[2][40, :TOPK] = torch.tensor([p * K + s for p in sorted(chosen[1:] + [free]) for s in range(K)])
    base = 42 // K  # pools of document 2 start at global pool 42 // 4 = 9 + 1 + ... (documents 0, 1)
    base = 37 // K + 5 // K
    scores[42 + 40, [base + p for p in chosen]] = 1.0
    scores[42 + 40, base + free] = 1.0 - 1e-6  # a near-tie with the boundary
    got = replay.shard(toks, seq1, config, missing="fail")
    rep = replay.compare(got, ref, seq1, scores=scores, kpool=K)
    assert rep["rows_differing"] == 1 and rep["rows_near_ties"] == 1 and rep["rows_beyond_ties"] == 0
    scores[42 + 40, base + free] = 0.5  # far below the boundary: a real difference
    rep = replay.compare(got, ref, seq1, scores=scores, kpool=K)
    assert rep["rows_near_ties"] == 0 and rep["rows_beyond_ties"] == 1


# --------------------------------------------------------------------------- gloo ranks


def _gloo_replay(rank, world_size, layout):
    import torch.distributed as dist

    torch.set_num_threads(1)
    x = _problem(seed=3)
    results = []
    for config in CONFIGS[:2]:
        ref, seq1 = _world1(x, config)
        toks = replay.documents(ref, seq1)
        if layout == "positions":
            seq = ShardedSequence.from_positions(x.cu_seq_lens, random_rank_positions(sum(LENGTHS), world_size, 5)[rank],
                                                 world_size=world_size, rank=rank, group=dist.group.WORLD)  # fmt: skip
        else:
            seq = ShardedSequence.split(x.cu_seq_lens, world_size, rank, dist.group.WORLD, layout=layout)
        inputs = shard_inputs(x, seq)
        computed = kpool_topk(**inputs, seq=seq, config=config)
        got = replay.shard(toks, seq, config, missing="fail")
        # rows not covered computed by kpool_topk (a collective: every rank computes)
        partial = replay.shard(_truncated(toks, 2), seq, config, inputs=inputs)
        same = replay.compare(got, computed, seq)
        wrong = [c.clone() for c in toks]
        wrong[2][50, :K] = wrong[2][50, K : 2 * K]  # a duplicate pool in row 50 of document 2
        try:
            replay.shard(wrong, seq, config, missing="fail")
            message = None
        except ValueError as exc:
            message = str(exc)
        results.append((torch.equal(got, computed), torch.equal(partial, computed), same, message))
    return results


@pytest.mark.parametrize("world_size, layout", [(2, "contiguous"), (3, "zigzag"), (4, "zigzag-per-document"),
                                                (3, "positions")])  # fmt: skip
def test_gloo_ranks_replay_equals_kpool_topk_and_fail_alike(world_size, layout):
    results = run_ranks(_gloo_replay, world_size, (layout,), timeout=240)
    for c in range(2):
        per_rank = [r[c] for r in results]
        assert all(equal and partial for equal, partial, _, _ in per_rank), per_rank
        reports = [rep for _, _, rep, _ in per_rank]
        assert all(rep == reports[0] for rep in reports)
        assert reports[0]["rows"] == sum(LENGTHS) and reports[0]["rows_differing"] == 0
        messages = {m for *_, m in per_rank}
        assert len(messages) == 1, messages
        (message,) = messages
        assert "captured: document 2, row 50, column" in message and "selected twice in the row" in message, message


# --------------------------------------------------------------------------- KPoolIndexer modes


def _indexer(**kw):
    from sp_kpool import KPoolIndexer

    torch.manual_seed(0)
    m = KPoolIndexer(hidden_size=32, q_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=TOPK,
                     index_kpool=K, precision="bf16", dtype=torch.float32, **kw)  # fmt: skip
    for p in m.parameters():
        p.data.normal_()
    return m


def test_indexer_replay_and_verify_modes():
    seq = ShardedSequence.split([0, *np.cumsum(LENGTHS).tolist()], 1, 0)
    g = torch.Generator().manual_seed(1)
    hidden, q_resid = torch.randn(seq.shard_size, 32, generator=g), torch.randn(seq.shard_size, 16, generator=g)
    computed = _indexer()(hidden, q_resid, seq)
    capture = _truncated(replay.documents(computed, seq))  # the rollout has no row for the last token
    assert torch.equal(_indexer(mode="replay")(hidden, q_resid, seq, replay=capture), computed)
    empty = _indexer(mode="replay", replay_missing="empty")(hidden, q_resid, seq, replay=capture)
    assert (empty != computed).any(1).sum() == sum(1 for n in LENGTHS if n >= K)  # the last rows lost their history
    verify = _indexer(mode="verify")
    assert torch.equal(verify(hidden, q_resid, seq, replay=capture), computed)
    assert verify.last_comparison["rows"] == sum(LENGTHS) and verify.last_comparison["rows_differing"] == 0
    perturbed = [c.clone() for c in capture]
    row = perturbed[2][40]
    chosen = sorted({int(v) // K for v in row[:TOPK] if v >= 0})
    free = next(p for p in range(41 // K) if p not in chosen)
    row[:TOPK] = torch.tensor([p * K + s for p in sorted(chosen[1:] + [free]) for s in range(K)])
    ids = verify(hidden, q_resid, seq, replay=perturbed)  # the replayed ids are returned
    assert not torch.equal(ids, computed)
    rep = verify.last_comparison
    assert rep["rows_differing"] == 1 and rep["first_difference"]["document"] == 2
    assert rep["first_difference"]["row"] == 40
    sampled = _indexer(mode="verify", verify_rows=0.25)
    hit = None
    for seed in range(20):  # a seed whose sample holds the perturbed row, and one whose does not
        sampled.verify_seed = seed
        sample = replay.sample_rows(seq, 0.25, seed)
        assert sample.numel() == round(0.25 * sum(LENGTHS))
        assert torch.equal(sampled(hidden, q_resid, seq, replay=perturbed), ids)
        rep = sampled.last_comparison
        assert rep["rows"] == sample.numel() and (rep["verify_rows"], rep["verify_seed"]) == (0.25, seed)
        held = sum(LENGTHS[:2]) + 40 in sample.tolist()
        assert rep["rows_differing"] == int(held)
        hit = (hit or set()) | {held}
    assert hit == {True, False}
    with pytest.raises(TypeError, match="replay: given, but the module's mode is 'compute'"):
        _indexer()(hidden, q_resid, seq, replay=capture)
    with pytest.raises(TypeError, match="captured: expected a list"):
        _indexer(mode="replay")(hidden, q_resid, seq)
    with pytest.raises(ValueError, match="mode: expected one of"):
        _indexer(mode="both")


# --------------------------------------------------------------------------- rollout selection files


def test_rollout_file_round_trip_replays_at_another_world_size(tmp_path):
    import base64

    from sp_kpool import rollout

    x = _problem(seed=7)
    configs = [CONFIGS[0], CONFIGS[1]]
    refs = [_world1(x, c) for c in configs]
    seq1 = refs[0][1]
    layers = [replay.documents(ref, seq1, as_pools=True, kpool=K) for ref, _ in refs]  # two "layers"
    path = rollout.write_selections(tmp_path / "batch.safetensors", layers, ids="pools", kpool=K, topk=TOPK)
    got = rollout.read_selections(path)
    assert got.ids == "pools" and got.num_layers == 2 and got.num_docs == len(LENGTHS) and got.kpool == K
    assert {t.dtype for layer in got.layers for t in layer} == {torch.int8}  # at most 16 pools: int8
    for li, config in enumerate(configs):
        seqs = _seqs(x.cu_seq_lens, 3, "zigzag-per-document")
        outs = simulate_ranks(x, 3, seqs=seqs, topk=TOPK, kpool=K, tail=config.tail, order=config.order,
                              alignment=config.alignment)  # fmt: skip
        for s, computed in zip(seqs, outs):
            assert torch.equal(replay.shard_local(got.layer(li), s, config, ids="pools", missing="fail")[0], computed)
    assert rollout.narrowest(torch.tensor([127])) == torch.int8 and rollout.narrowest(torch.tensor([128])) == torch.int16
    assert rollout.narrowest(torch.tensor([40000])) == torch.int32
    # a flipped byte is reported, not replayed
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"bad.safetensors: tensor 'layer001.doc00004' fails its checksum"):
        rollout.read_selections(bad)
    with pytest.raises(ValueError, match="no such rollout selection file"):
        rollout.read_selections(tmp_path / "none.safetensors")
    with pytest.raises(ValueError, match=r"layers\[1\]: expected 5 documents \(as layer 0\), got 4"):
        rollout.write_selections(tmp_path / "x.safetensors", [layers[0], layers[1][:4]])
    assert not list(tmp_path.glob("*.tmp*"))
    # SGLang's per-request arrays: (seqlen - 1, num_layers, index_topk) int32, base64
    requests = []
    for d in range(len(LENGTHS)):
        per_layer = [replay.documents(ref, seq1)[d][:-1, :TOPK] for ref, _ in refs]  # history columns, no last row
        stacked = np.stack([p.numpy() for p in per_layer], axis=1).astype("<i4")
        requests.append({"meta_info": {"indexer_topk": base64.b64encode(stacked.tobytes()).decode()}})
    batch = rollout.sglang_batch(requests, num_layers=2, index_topk=TOPK)
    assert [a.shape for a in batch[0]] == [(n - 1, TOPK) for n in LENGTHS]
    for li, (ref, _) in enumerate(refs):
        inputs = shard_inputs(x, seq1)
        assert torch.equal(replay.shard(batch[li], seq1, configs[li], inputs=inputs), ref)
    with pytest.raises(ValueError, match="indexer_topk: expected a multiple of num_layers x index_topk = 32 values"):
        rollout.from_sglang(np.zeros(33, dtype=np.int32), num_layers=2, index_topk=TOPK)


def test_replay_report_table_json_and_plot(tmp_path):
    from sp_kpool.parity.report import replay_table, write_replay_outputs

    x = _problem()
    config = CONFIGS[0]
    ref, seq1 = _world1(x, config)
    toks = replay.documents(ref, seq1)
    same = replay.compare(replay.shard(toks, seq1, config, missing="fail"), ref, seq1)
    chosen = {int(v) // K for v in toks[2][40, :TOPK]}
    free = next(p for p in range(41 // K) if p not in chosen)
    toks[2][40, :K] = free * K + torch.arange(K)  # one pool swapped for another visible one
    other = replay.compare(replay.shard(toks, seq1, config, missing="fail"), ref, seq1)
    table = replay_table([same, other])
    assert table.splitlines()[0].split()[:3] == ["layer", "rows", "differing"]
    assert other["rows_differing"] == 1 and "doc 2 row 40 (stream 82)" in table, table
    written = write_replay_outputs([same, other], tmp_path)
    assert [p.name for p in written] == ["replay.json", "replay.txt", "replay_layers.png"]
    assert json.loads(written[0].read_text())[0]["rows_differing"] == 0
    assert written[2].stat().st_size > 1000


def test_inputs_tuple_in_the_operators_order_and_errors_name_inputs():
    config = CONFIGS[0]
    x = _problem()
    ref, seq1 = _world1(x, config)
    caps = _truncated(replay.documents(ref, seq1), drop=2)
    given = shard_inputs(x, seq1)
    in_order = tuple(given[k] for k in replay.INPUTS)
    assert replay.INPUTS == ("q", "k", "gates", "head_weights", "ape")
    assert torch.equal(replay.shard(caps, seq1, config, inputs=in_order), ref)
    assert torch.equal(replay.shard(caps, seq1, config, inputs=list(in_order)), ref)
    assert torch.equal(replay.shard(caps, seq1, config, inputs=lambda: in_order), ref)
    wrong = {**given, "weights": given["head_weights"]}
    del wrong["head_weights"]
    with pytest.raises(ValueError, match=r"inputs\['weights'\]: unknown key \(expected the keys q, k, gates, "
                                         r"head_weights, ape\)"):  # fmt: skip
        replay.shard(caps, seq1, config, inputs=wrong)
    without = {k: v for k, v in given.items() if k != "ape"}
    with pytest.raises(ValueError, match=r"inputs\['ape'\]: missing \(expected the keys"):
        replay.shard(caps, seq1, config, inputs=without)
    with pytest.raises(ValueError, match=r"inputs\['ape'\]: missing"):  # from the callable, after the agreement
        replay.shard(caps, seq1, config, inputs=lambda: without)
    with pytest.raises(ValueError, match=r"inputs: expected 5 tensors in the operator's order \(q, k, gates, "
                                         r"head_weights, ape\), got 4"):  # fmt: skip
        replay.shard(caps, seq1, config, inputs=in_order[:4])
    with pytest.raises(TypeError, match=r"inputs\[2\] \(gates\): expected a tensor, got NoneType"):
        replay.shard(caps, seq1, config, inputs=(*in_order[:2], None, *in_order[3:]))
    with pytest.raises(TypeError, match=r"inputs: expected a dict of tensors"):
        replay.shard(caps, seq1, config, inputs=given["q"])
