"""Capture a live indexer call, replay it in two arms, and check the reported numbers
against values computed here, independently, on a small input."""

import json
import math

import pytest
import torch

from sp_kpool import KPoolIndexer, ShardedSequence, kpool_topk, serving
from sp_kpool.backends import BACKENDS
from sp_kpool.backends.base import ChunkScores
from sp_kpool.backends.torch_backend import TorchBackend
from sp_kpool.capture import CaptureError, enable, load_capture, load_capture_set
from sp_kpool.cli import main
from sp_kpool.parity import Arm, format_table, make_synthetic_capture, replay, write_outputs
from sp_kpool.parity.rebuild import rebuild_indexer
from sp_kpool.testing.dist import run_ranks

HIDDEN, Q_LORA, H, D, K, T = 32, 24, 8, 16, 4, 16  # D a power of two (fp8); H >= 8 (contract §9)
LENGTHS = [37, 22, 9]  # 68 tokens: partial pools, a document too short for a Top-K choice
#: Relative agreement of our float64 recomputation with the FP32 values in the report.
REL = 1e-4


def _indexer(precision="bf16", dtype=torch.bfloat16, **kw):
    m = KPoolIndexer(hidden_size=HIDDEN, q_lora_rank=Q_LORA, index_n_heads=H, index_head_dim=D, index_topk=T,
                     index_kpool=K, precision=precision, dtype=dtype, **kw)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for name, p in m.named_parameters():
        v = torch.randn(p.shape, generator=g) * (1.0 if "norm" in name or "ape" in name else p.shape[-1] ** -0.5)
        p.copy_(v + (1.0 if name == "k_norm.weight" else 0.0))
    return m


def _inputs(S, dtype=torch.bfloat16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, HIDDEN, generator=g).to(dtype), torch.randn(S, Q_LORA, generator=g).to(dtype)


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


@pytest.fixture
def captured(tmp_path):
    """A live world-size-1 call captured with precision fp8: (path, ids, module, hidden, q_resid)."""
    m = _indexer("fp8", capture_dir=str(tmp_path))
    hidden, q_resid = _inputs(sum(LENGTHS))
    ids = m(hidden, q_resid, ShardedSequence.split(_cu(LENGTHS), world_size=1, rank=0))
    (path,) = tmp_path.glob("*.safetensors")
    return path, ids, m, hidden, q_resid


def test_capture_round_trip_keeps_result_and_inputs(captured, tmp_path):
    path, ids, m, hidden, q_resid = captured
    plain = _indexer("fp8")
    assert plain._capture is None  # no capture argument, no environment: no hook
    seq = ShardedSequence.split(_cu(LENGTHS), world_size=1, rank=0)
    assert torch.equal(ids, plain(hidden, q_resid, seq))  # capturing does not change the result
    assert m(hidden, q_resid, seq) is not None and len(list(tmp_path.glob("*.safetensors"))) == 1  # calls=1
    assert path.name.endswith("-call0000.rank000-of-001.safetensors")
    c = load_capture(path)
    for name, want in (("hidden", hidden), ("q_resid", q_resid), ("ids", ids)):
        got = getattr(c, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert torch.equal(c.cu_seq_lens, torch.tensor(_cu(LENGTHS)))
    state = m.state_dict()
    assert set(c.params) == set(state) and len(state) == 7
    assert all(torch.equal(c.params[n], state[n]) for n in state)
    assert (c.meta["precision"], c.meta["backend_resolved"], c.meta["topk"], c.meta["kpool"], c.meta["heads"]) == ("fp8", "torch", T, K, H)
    rebuilt = rebuild_indexer(c, "cpu")
    assert rebuilt._capture is None and all(torch.equal(rebuilt.state_dict()[n], state[n]) for n in state)
    rep = replay(path, "fp8:torch", "bf16", repeat=False)
    assert rep["arms"]["A"]["reproduces_captured_ids"] is True
    assert rep["arms"]["B"]["reproduces_captured_ids"] is None  # not the captured arm


def test_environment_variable_turns_capture_on(tmp_path):
    from sp_kpool.settings import Settings

    env = {"SP_KPOOL_CAPTURE_DIR": str(tmp_path / "env"), "SP_KPOOL_CAPTURE_CALLS": "2"}
    m = _indexer("bf16", settings=Settings.from_env(env))
    hidden, q_resid = _inputs(12)
    seq = ShardedSequence.split([0, 12], world_size=1, rank=0)
    for _ in range(3):
        m(hidden, q_resid, seq)
    names = sorted(p.name for p in (tmp_path / "env").glob("*.safetensors"))
    assert len(names) == 2 and "-call0000." in names[0] and "-call0001." in names[1]
    enable(m, None)
    assert m._capture is None
    with pytest.raises(ValueError, match="SP_KPOOL_CAPTURE_CALLS: expected a non-negative integer, got 'many'"):
        Settings.from_env({**env, "SP_KPOOL_CAPTURE_CALLS": "many"})


# ---------------------------------------------------------------- independent numbers


def _sylvester(d):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def _pools_and_scores(prep, precision, starts):
    """Pools in model space (float64) and all-pairs scores (float64), written out here."""
    k, gates, ape, q, w = prep["k"], prep["gates"], prep["ape"], prep["q"], prep["head_weights"]
    idx = torch.tensor(starts)[:, None] + torch.arange(K)
    if precision == "bf16":  # model arithmetic: FP32 softmax, weighted sum in the key dtype
        probs = (gates[idx].float() + ape.float()).softmax(1).to(k.dtype)
        pools = (probs * k[idx]).sum(1).double()
    else:
        pools = serving.compress_pools_decode(k, gates, ape, torch.tensor(starts)).to(torch.bfloat16).double()
    if precision == "fp8":
        k8, ks = serving.prepare_pools_fp8(k, gates, ape, torch.tensor(starts))
        q8, wq = serving.prepare_queries_fp8(q, w)
        deq = k8.double() * ks.double()[:, None]
        s = torch.relu(torch.einsum("thd,pd->thp", q8.double(), k8.double()))
        scores = torch.einsum("th,thp->tp", wq.double(), s) * ks.double()
        return deq @ _sylvester(D), deq, scores  # rotated back (Sylvester H is symmetric)
    s = torch.relu(torch.einsum("thd,pd->thp", q.double(), pools) * D**-0.5)
    return pools, pools @ _sylvester(D), torch.einsum("th,thp->tp", w.double() * H**-0.5, s)


def _history_sets(ids, cu):
    """Per row, the history token ids (row minus its tail) -- Jaccard over these equals
    Jaccard over pools, since pools are disjoint blocks of K tokens."""
    out = []
    for t, row in enumerate(ids.tolist()):
        start = max(c for c in cu if c <= t and c < cu[-1])
        tail = set(range(t - (t - start + 1) % K + 1, t + 1))
        out.append({v for v in row if v >= 0} - tail)
    return out


@pytest.mark.parametrize("arm_a, arm_b", [("fp8", "bf16-serving"), ("fp8", "bf16")])
def test_reported_numbers_match_an_independent_computation(captured, arm_a, arm_b):
    path, _, m, hidden, q_resid = captured
    rep = replay(path, arm_a, arm_b, device="cpu")
    cu = _cu(LENGTHS)
    starts = [c0 + K * i for c0, n in zip(cu, LENGTHS) for i in range(n // K)]
    rows_j = [(t, t - max(c for c in cu[:-1] if c <= t)) for t in range(cu[-1])]
    valid = torch.zeros(cu[-1], len(starts), dtype=torch.bool)
    first_pool = {c0: sum(n // K for n in LENGTHS[:d]) for d, c0 in enumerate(cu[:-1])}
    for t, j in rows_j:
        p0 = first_pool[t - j]
        valid[t, p0 : p0 + (j + 1) // K] = True
    want_slots = sum((j + 1) // K for _, j in rows_j)
    assert int(valid.sum()) == want_slots
    for arm in ("A", "B"):
        assert rep["arms"][arm]["valid_slots"] == want_slots
        assert rep["arms"][arm]["nan_in_valid_slots"] == rep["arms"][arm]["inf_in_valid_slots"] == 0
        assert rep["arms"][arm]["repeat_bitwise_equal"]["all"] is True

    prep = {p: m.prepare(hidden, q_resid, p) for p in (arm_a, arm_b)}
    model_a, rot_a, sa = _pools_and_scores(prep[arm_a], arm_a, starts)
    model_b, rot_b, sb = _pools_and_scores(prep[arm_b], arm_b, starts)
    d = rep["diff"]
    assert d["pools_model_space"]["max_abs"] == pytest.approx(float((model_a - model_b).abs().max()), rel=REL)
    assert d["pools_model_space"]["rel_l2"] == pytest.approx(float((model_a - model_b).norm() / model_b.norm()), rel=REL)
    assert d["pools_rotated_space"]["rel_l2"] == pytest.approx(float((rot_a - rot_b).norm() / rot_b.norm()), rel=REL)
    diff = (sa - sb)[valid]
    assert d["scores"]["compared"] == want_slots
    assert d["scores"]["rel_l2"] == pytest.approx(float(diff.norm() / sb[valid].norm()), rel=REL)
    assert d["scores"]["max_abs"] == pytest.approx(float(diff.abs().max()), rel=REL)
    for name in ("k", "head_weights"):
        x, y = prep[arm_a][name].double(), prep[arm_b][name].double()
        s = d["keys" if name == "k" else "head_weights"]
        assert s["differing"] == int((x != y).sum())
        assert s["max_abs"] == pytest.approx(float((x - y).abs().max()), rel=1e-6)
    # (on CPU, BF16 LayerNorm and Linear accumulate in FP32 as the serving preparation does,
    # so keys and head weights often agree there; the pool statistics above are non-zero)

    seq = ShardedSequence.split(cu, world_size=1, rank=0)
    sets = {
        p: _history_sets(kpool_topk(**prep[p], seq=seq, topk=T, kpool=K, precision=p, backend="torch"), cu)
        for p in (arm_a, arm_b)
    }
    choice = [(j + 1) // K > T // K for _, j in rows_j]
    differ = [a != b for a, b in zip(sets[arm_a], sets[arm_b])]
    jac = [len(a & b) / len(a | b) for a, b, c in zip(sets[arm_a], sets[arm_b], choice) if c]
    t = d["topk"]
    assert (t["rows"], t["rows_with_choice"], t["rows_differing"]) == (cu[-1], sum(choice), sum(differ))
    assert sum(differ) > 0  # the case is not vacuous: fp8 flips some selections
    assert not any(x and not c for x, c in zip(differ, choice))  # only rows with a choice can differ
    assert t["fraction_of_rows_with_choice"] == pytest.approx(sum(differ) / sum(choice))
    assert t["jaccard_rows_with_choice"]["min"] == pytest.approx(min(jac))
    assert t["jaccard_rows_with_choice"]["mean"] == pytest.approx(sum(jac) / len(jac))
    assert rep["per_query"]["jaccard"] == pytest.approx([len(a & b) / len(a | b) if a | b else 1.0 for a, b in zip(sets[arm_a], sets[arm_b])])
    assert d["ids_bitwise_equal"] is False

    table = format_table(rep)
    assert f"{want_slots:,}" in table
    assert "queries whose Top-K pool sets differ" in table and f"{sum(differ)} (" in table
    assert f"{d['scores']['rel_l2']:.4g}" in table
    assert "pools, rotated space (as fp8 stores them)" in table and "fp8 rotated back" in table


def test_identical_arms_give_zero_differences_and_bitwise_equal(captured, tmp_path):
    path = captured[0]
    rep = replay(path, "fp8", "fp8:torch")
    d = rep["diff"]
    assert d["ids_bitwise_equal"] and d["pools_bitwise_equal"] and d["queries_bitwise_equal"]
    for s in (d["keys"], d["head_weights"], d["pools_model_space"], d["pools_rotated_space"], d["scores"]):
        assert s["max_abs"] == 0 and s["rel_l2"] == 0
    assert d["scores"]["bitwise_equal_slots"] == d["scores"]["compared"] == rep["arms"]["A"]["valid_slots"] > 0
    assert d["topk"]["rows_differing"] == 0 and set(rep["per_query"]["jaccard"]) == {1.0}
    assert rep["arms"]["A"]["reproduces_captured_ids"] and rep["arms"]["B"]["reproduces_captured_ids"]
    table = format_table(rep)
    assert "ids bitwise equal (whole output)" in table
    flags = [ln.split()[-1] for ln in table.splitlines() if "bitwise equal" in ln and "slots" not in ln]
    assert flags == ["yes"] * 6 and "NO" not in table.split()
    files = write_outputs(rep, tmp_path / "out")
    assert sorted(p.name for p in files) == ["overlap_vs_position.png", "parity.json", "parity.txt", "score_diff_hist.png"]
    assert json.loads((tmp_path / "out" / "parity.json").read_text())["diff"]["ids_bitwise_equal"] is True
    assert (tmp_path / "out" / "score_diff_hist.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _CompactTorch(TorchBackend):
    """A backend registered by name later (as GPU backends are): torch scores returned in
    request-local columns, ``-inf`` outside each row's range, optionally a NaN in the first
    valid slot of every row."""

    name = "compact-test"

    def __init__(self, poison=False):
        self.poison = poison

    def score(self, problem, pooled, q, w, lo, hi, starts, ends):
        full = super().score(problem, pooled, q, w, lo, hi).scores
        lens = (ends - starts).long()
        W = max(1, int(lens.max()))
        cols = torch.arange(W)
        local = torch.gather(full, 1, (starts.long()[:, None] + cols).clamp(max=hi - lo - 1))
        local = local.masked_fill(cols[None] >= lens[:, None], -math.inf)
        if self.poison:
            local[:, 0] = torch.where(lens > 0, math.nan, local[:, 0])
        return ChunkScores(local, col_offset=starts.long(), masked=True)


def test_backends_resolve_by_name_and_compact_columns_map_back(captured, monkeypatch):
    monkeypatch.setitem(BACKENDS, "compact-test", _CompactTorch())
    rep = replay(captured[0], "fp8:compact-test", "fp8:torch")
    d, A = rep["diff"], rep["arms"]["A"]
    assert A["backend"] == "compact-test" and A["repeat_bitwise_equal"]["all"]
    assert d["scores"]["bitwise_equal_slots"] == d["scores"]["compared"] == A["valid_slots"] > 0
    assert A["nan_in_valid_slots"] == A["inf_in_valid_slots"] == 0  # the -inf lie outside the valid slots
    assert d["ids_bitwise_equal"] and d["topk"]["rows_differing"] == 0

    monkeypatch.setitem(BACKENDS, "compact-test", _CompactTorch(poison=True))
    rep = replay(captured[0], "fp8:compact-test", "fp8:torch", repeat=False)
    rows_with_pools = sum(1 for n in LENGTHS for j in range(n) if (j + 1) // K > 0)
    assert rep["arms"]["A"]["nan_in_valid_slots"] == rows_with_pools
    assert rep["diff"]["scores"]["compared"] == rep["arms"]["A"]["valid_slots"] - rows_with_pools
    (line,) = [ln for ln in format_table(rep).splitlines() if ln.startswith("NaN in valid slots")]
    assert line.split()[-2:] == [f"{rows_with_pools:,}", "0"]


class _Recording(TorchBackend):
    name = "record-test"

    def __init__(self):
        self.calls = []

    def score(self, problem, pooled, q, w, lo, hi, starts, ends):
        self.calls.append((lo, hi, starts.clone(), ends.clone(), q.clone(), w.clone()))
        return super().score(problem, pooled, q, w, lo, hi, starts, ends)


def test_replayed_scores_are_the_drivers_own_calls(tmp_path, monkeypatch):
    """The scores compared are those the selection ranked: replay makes the very
    ``backend.score`` calls of the pipeline (rank 1 of 2: foreign rows of a chunk are
    zero with empty ranges)."""
    rec = _Recording()
    monkeypatch.setitem(BACKENDS, "record-test", rec)
    kw = dict(tokens=90, hidden_size=HIDDEN, q_lora_rank=Q_LORA, heads=H, head_dim=D, topk=T, kpool=K)
    # 6-row chunks: one straddles the shards; the replay uses the captured budget
    paths = make_synthetic_capture(tmp_path, world_size=2, max_logits_bytes=3000, **kw)
    assert load_capture(paths[1]).meta["max_logits_bytes"] == 3000
    rep = replay(paths[1], "fp8:record-test", "fp8:torch", repeat=False)
    assert rep["diff"]["scores"]["bitwise_equal_slots"] == rep["diff"]["scores"]["compared"] > 0
    n = len(rec.calls) // 2
    assert n == 8 and len(rec.calls) == 2 * n  # rows [42, 90) in chunks of 6
    driver_calls, ours = rec.calls[:n], list(rec.calls[n:])

    def same(x, y):
        return x[:2] == y[:2] and all(torch.equal(u, v) for u, v in zip(x[2:], y[2:]))

    # the same calls; the driver makes those of chunks wholly its own first (no padded
    # copies before its first scoring call), the replay goes in row order
    for call in driver_calls:
        match = [i for i, c in enumerate(ours) if same(call, c)]
        assert len(match) == 1, f"driver call on pools [{call[0]}, {call[1]}) not made once by the replay"
        ours.pop(match[0])
    assert same(driver_calls[-1], rec.calls[n])  # rows 42-47 straddle the shards: the driver's last chunk
    first_ends = rec.calls[n][3]
    assert first_ends[:3].tolist() == [0, 0, 0] and int(first_ends[3:].min()) > 0  # rows 42-44 belong to rank 0


class _RowLocal(_Recording):
    name = "record-row-local"
    row_local_scores = True  # as deepgemm and triton: a partial chunk is scored as its rows here


def test_replay_makes_the_drivers_row_local_calls(tmp_path, monkeypatch):
    """With ``row_local_scores`` the driver scores its rows [45, 90) in chunks of its own
    (``plan.local_chunks``: 8 chunks from row 45, the last of 3 rows, no row of rank 0), and
    the replay makes those same calls and compares the same values (the torch FP8
    arithmetic gives every cell the same bits in any call)."""
    rec = _RowLocal()
    monkeypatch.setitem(BACKENDS, "record-row-local", rec)
    kw = dict(tokens=90, hidden_size=HIDDEN, q_lora_rank=Q_LORA, heads=H, head_dim=D, topk=T, kpool=K)
    paths = make_synthetic_capture(tmp_path, world_size=2, max_logits_bytes=3000, **kw)
    rep = replay(paths[1], "fp8:record-row-local", "fp8:torch", repeat=False)
    assert rep["diff"]["scores"]["bitwise_equal_slots"] == rep["diff"]["scores"]["compared"] > 0
    assert rep["diff"]["ids_bitwise_equal"]
    n = len(rec.calls) // 2
    assert n == 8 and len(rec.calls) == 2 * n
    rows = [c[4].shape[0] for c in rec.calls]
    assert rows == ([6] * 7 + [3]) * 2  # the driver's calls, then the replay's, in row order both
    for x, y in zip(rec.calls[:n], rec.calls[n:]):
        assert x[:2] == y[:2] and all(torch.equal(u, v) for u, v in zip(x[2:], y[2:]))
    assert all(int(c[3].min()) > 0 for c in rec.calls)  # no zero row of empty range: every row is this rank's


# ---------------------------------------------------------------- several ranks


LIVE_LENGTHS = [37, 22, 8]  # 67 tokens on 2 ranks: padded to 68, the last row is padding


def _live_rank(rank, world_size, directory):
    m = _indexer("bf16-serving", capture_dir=directory)
    hidden, q_resid = _inputs(sum(LIVE_LENGTHS))
    seq = ShardedSequence.split(_cu(LIVE_LENGTHS), world_size=world_size, rank=rank)
    a, b = seq.shard_start, seq.shard_end
    pad = lambda x: torch.cat([x, x.new_zeros(seq.total_length - x.shape[0], x.shape[1])])[a:b]  # noqa: E731
    return m(pad(hidden), pad(q_resid), seq)


def test_live_multi_rank_capture_replays_each_rank(tmp_path):
    world = 2
    outs = run_ranks(_live_rank, world, (str(tmp_path),), timeout=120)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert [f.name.split(".")[1] for f in files] == [f"rank{r:03d}-of-{world:03d}" for r in range(world)]
    m = _indexer("bf16-serving")
    seq1 = ShardedSequence.split(_cu(LIVE_LENGTHS), world_size=1, rank=0)
    ref = m(*_inputs(sum(LIVE_LENGTHS)), seq1)
    for r, f in enumerate(files):
        cap, caps = load_capture_set(f)
        assert cap.rank == r and len(caps) == world and torch.equal(cap.ids, outs[r])
        assert caps[0].meta["source"] == "live"
        rep = replay(f, "bf16-serving:torch", "fp8", repeat=False)
        assert rep["arms"]["A"]["reproduces_captured_ids"] is True
        n = rep["capture"]["real_rows"]
        assert torch.equal(outs[r][:n], ref[34 * r : 34 * r + n])  # contract §7: equal to world size 1
    assert rep["capture"]["real_rows"] == 33  # the padding row is not a query
    files[1].unlink()
    with pytest.raises(CaptureError, match=r"rank 1 of 2 is needed .* does not exist"):
        replay(files[0], "fp8", "bf16")


def _live_rank_layout(rank, world_size, directory, layout):
    m = _indexer("bf16-serving", capture_dir=directory)
    hidden, q_resid = _inputs(sum(LIVE_LENGTHS))
    seq = ShardedSequence.split(_cu(LIVE_LENGTHS), world_size, rank, layout=layout)
    real = seq.real_of_stream[seq.positions]
    rows = lambda x: torch.where((real >= 0)[:, None], x[real.clamp(min=0)], 0.0)  # noqa: E731
    return m(rows(hidden), rows(q_resid), seq), real


@pytest.mark.parametrize("layout", ["zigzag", "zigzag-per-document"])
def test_live_capture_of_a_layout_replays_each_rank(tmp_path, layout):
    # the capture records the ownership; the replay rebuilds it and reproduces the ids
    outs = run_ranks(_live_rank_layout, 2, (str(tmp_path), layout), timeout=120)
    ref = _indexer("bf16-serving")(*_inputs(sum(LIVE_LENGTHS)), ShardedSequence.split(_cu(LIVE_LENGTHS), 1, 0))
    for r, f in enumerate(sorted(tmp_path.glob("*.safetensors"))):
        cap, _ = load_capture_set(f)
        seq = cap.seq()
        assert seq.layout == layout and torch.equal(seq.positions, ShardedSequence.split(
            _cu(LIVE_LENGTHS), 2, r, layout=layout).positions)  # fmt: skip
        rep = replay(f, "bf16-serving:torch", "fp8", repeat=False)
        assert rep["arms"]["A"]["reproduces_captured_ids"] is True and rep["capture"]["layout"] == layout
        ids, real = outs[r]
        keep = real >= 0
        assert rep["capture"]["real_rows"] == int(keep.sum())
        assert torch.equal(seq.real_ids(ids)[keep], ref[real[keep]])
        assert rep["per_query"]["row"] == sorted(real[keep].tolist())


def test_synthetic_multi_rank_capture_and_cli(tmp_path, capsys):
    kw = dict(tokens=90, docs=2, hidden_size=HIDDEN, q_lora_rank=Q_LORA, heads=H, head_dim=D, topk=T, kpool=K)
    paths = make_synthetic_capture(tmp_path / "cap", world_size=2, precision="fp8", **kw)
    rep = replay(paths[1], "fp8", "bf16", repeat=False)
    assert rep["capture"]["shard"] == [45, 90] and rep["arms"]["A"]["reproduces_captured_ids"] is True
    argv = ["parity", "--synthetic", "--quiet", "--no-plots", "--device", "cpu", "--out", str(tmp_path / "cli")]
    argv += ["--tokens", "90", "--hidden-size", str(HIDDEN), "--q-lora-rank", str(Q_LORA), "--heads", str(H)]
    argv += ["--head-dim", str(D), "--topk", str(T), "--a", "bf16-serving", "--b", "bf16"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "A = bf16-serving:auto -> backend torch" in out and "wrote" in out
    saved = json.loads((tmp_path / "cli" / "parity.json").read_text())
    assert saved["capture"]["source"] == "synthetic" and saved["arms"]["B"]["precision"] == "bf16"
    assert (tmp_path / "cli" / "capture" / "synthetic-call0000.rank000-of-001.safetensors").is_file()


# ---------------------------------------------------------------- bad files and arms


def _damaged(path, tmp_path, how):
    data = bytearray(path.read_bytes())
    bad = tmp_path / f"{how}.rank000-of-001.safetensors"
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "header":
        data[8:16] = b"{garbage"
    elif how == "flipped":
        data[-3] ^= 0x40
    bad.write_bytes(bytes(data))
    return bad


@pytest.mark.parametrize("how, text", [
    ("truncated", "cannot be read as safetensors, the file is truncated or corrupted"),
    ("header", "cannot be read as safetensors, the file is truncated or corrupted"),
    ("flipped", r"fails its checksum \(stored crc32 0x[0-9a-f]{8}, computed 0x[0-9a-f]{8}\): the file is corrupted"),
])  # fmt: skip
def test_damaged_files_give_a_clear_error(captured, tmp_path, capsys, how, text):
    bad = _damaged(captured[0], tmp_path, how)
    with pytest.raises(CaptureError, match=text) as err:
        replay(bad, "fp8", "bf16")
    assert str(err.value).startswith(f"{bad}: ")
    assert main(["parity", str(bad), "--quiet"]) == 2
    assert f"error: {bad}: " in capsys.readouterr().err


def test_files_that_are_not_captures_give_a_clear_error(captured, tmp_path):
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    other = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, str(other))
    with pytest.raises(CaptureError, match=r"weights.safetensors: not an sp_kpool capture \(metadata 'format' is None"):
        load_capture(other)
    with pytest.raises(CaptureError, match="nothing.safetensors: no such capture file"):
        load_capture(tmp_path / "nothing.safetensors")
    tensors = load_file(str(captured[0]))
    with safe_open(str(captured[0]), "pt") as fh:
        meta = fh.metadata()
    edited = tmp_path / "edited.rank000-of-001.safetensors"
    save_file(tensors, str(edited), {**meta, "precision": "fp4"})
    with pytest.raises(CaptureError, match=r"metadata 'precision': expected one of \['bf16', 'bf16-serving', 'fp8'\], got 'fp4'"):
        load_capture(edited)
    save_file({k: v for k, v in tensors.items() if k != "q_resid"}, str(edited), meta)
    with pytest.raises(CaptureError, match=r"missing tensors \['q_resid'\]"):
        load_capture(edited)


def test_bad_arms():
    assert Arm.parse("bf16-serving") == Arm("bf16-serving", "auto") and str(Arm.parse("fp8:torch")) == "fp8:torch"
    with pytest.raises(ValueError, match=r"arm: expected precision\[:backend\] with precision in .*, got 'fp16'"):
        Arm.parse("fp16")
    with pytest.raises(ValueError, match=r"arm 'fp8:cuda': backend expected one of \['auto', 'torch'.*got 'cuda'"):
        Arm.parse("fp8:cuda")


def test_capture_records_the_compression_schedule_and_replay_uses_it(tmp_path):
    # a live fp8 call with prompt lengths: the capture holds them, the replay of the same
    # arm reproduces the live ids, and "+decode" replays every pool in decode order
    m = _indexer("fp8", capture_dir=str(tmp_path))
    hidden, q_resid = _inputs(sum(LENGTHS))
    prompts = [21, 10, 9]  # mid-pool (5 extend pools of 9), 2 pools + 2 tokens (2 of 5), the whole document (2 of 2)
    seq = ShardedSequence.split(_cu(LENGTHS), world_size=1, rank=0, prompt_lens=prompts)
    ids = m(hidden, q_resid, seq)
    (path,) = tmp_path.glob("*.safetensors")
    cap = load_capture(path)
    assert cap.prompt_lens.tolist() == prompts and cap.seq().prompt_lens == tuple(prompts)
    rep = replay(path, "fp8:torch", "fp8:torch+decode", repeat=False)
    A, B = rep["arms"]["A"], rep["arms"]["B"]
    assert A["reproduces_captured_ids"] is True and rep["capture"]["prompt_lens"] == prompts
    assert "extend order (9 of 16 pools)" in A["schedule"] and B["schedule"].startswith("all decode order (+decode")
    assert B["reproduces_captured_ids"] is None  # another arm than the live one
    assert isinstance(rep["diff"]["pools_differing"], int)
    assert "pools of A: prompt pools in extend order" in format_table(rep)
    assert torch.equal(ids, m(hidden, q_resid, seq))


def test_capture_without_prompt_lens_replays_as_all_decode(captured):
    path, ids, *_ = captured
    cap = load_capture(path)
    assert cap.prompt_lens is None and cap.seq().prompt_lens is None
    rep = replay(path, "fp8:torch", "bf16:torch", repeat=False)
    assert rep["arms"]["A"]["schedule"].startswith("all decode order (the capture has no prompt lengths")
    assert rep["arms"]["B"]["schedule"] == "model definition (one order)"
    assert rep["arms"]["A"]["reproduces_captured_ids"] is True


def test_arm_parse_takes_the_decode_suffix():
    assert Arm.parse("fp8+decode") == Arm("fp8", "auto", True) and str(Arm.parse("fp8:torch+decode")) == "fp8:torch+decode"
    with pytest.raises(ValueError, match=r"expected the suffix '\+decode' or none, got '\+extend'"):
        Arm.parse("fp8+extend")


def test_a_capture_without_head_gate_metadata_is_reported_as_rounded(captured, tmp_path):
    # sp_kpool.capture/1 files written before the FP32 head gate have no "head_gate" metadata: the report
    # says their serving-arm ids need not reproduce
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = captured[0]
    with safe_open(str(path), framework="pt") as fh:
        meta = dict(fh.metadata())
        tensors = {n: fh.get_tensor(n) for n in fh.keys()}
    assert meta.pop("head_gate") == "fp32"
    meta["format"] = "sp_kpool.capture/1"  # the version of the files from before the FP32 head gate
    old = tmp_path / "old" / path.name
    old.parent.mkdir()
    save_file(tensors, str(old), metadata=meta)
    assert load_capture(old).meta["head_gate"] == "rounded to the parameter dtype"
    rep = replay(old, "fp8:torch", "fp8:torch", repeat=False)
    assert rep["capture"]["head_gate"] == "rounded to the parameter dtype"
    assert "its serving-arm ids need not reproduce" in format_table(rep)
    assert "need not reproduce" not in format_table(replay(path, "fp8:torch", "fp8:torch", repeat=False))


def test_cli_default_folder_and_a_capture_without_choice(tmp_path, monkeypatch, capsys):
    """Without --out the files go to a new folder of the current directory, named; a
    capture where no row has a Top-K choice (tokens <= topk) says so in the table (and on
    the overlap plot) instead of showing an empty axis."""
    monkeypatch.chdir(tmp_path)
    argv = ["parity", "--synthetic", "--quiet", "--device", "cpu", "--tokens", str(T), "--hidden-size", str(HIDDEN),
            "--q-lora-rank", str(Q_LORA), "--heads", str(H), "--head-dim", str(D), "--topk", str(T), "--a", "bf16",
            "--b", "bf16"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "no row of this capture has a Top-K choice" in out
    folders = list(tmp_path.glob("sp_kpool-parity-*"))
    assert len(folders) == 1 and (folders[0] / "parity.json").is_file() and (folders[0] / "overlap_vs_position.png").is_file()
    assert f"the files are in {folders[0].name}/" in out


def test_cli_without_matplotlib_writes_the_files_skips_the_plots_and_exits_0(tmp_path, monkeypatch, capsys):
    """matplotlib missing (simulated: ``import matplotlib`` raises ImportError) is found before
    the work: the JSON and text are written, the skipped plots are said, and the exit is 0."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    out_dir = tmp_path / "cli"
    argv = ["parity", "--synthetic", "--quiet", "--device", "cpu", "--out", str(out_dir), "--tokens", "40",
            "--hidden-size", str(HIDDEN), "--q-lora-rank", str(Q_LORA), "--heads", str(H), "--head-dim", str(D),
            "--topk", str(T), "--a", "bf16", "--b", "bf16"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "note: the two PNG plots will be skipped: matplotlib is not importable" in captured.err
    assert "skipped the plots: matplotlib is not importable" in captured.out
    assert "pip install matplotlib" in captured.out
    assert (out_dir / "parity.json").is_file() and (out_dir / "parity.txt").is_file()
    assert not list(out_dir.glob("*.png"))


def test_cli_help_shows_defaults(capsys):
    for cmd in ("demo", "parity"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "(default: 0)" in text  # --seed
        assert ("(default: fp8)" in text) if cmd == "parity" else ("(default: 4099)" in text)


def test_cli_help_is_plain_text_and_shows_no_empty_default(capsys):
    """No reST markup (the module docstring's ``literals``) and no ``(default: None)`` for a
    flag whose default is said in its help (``--out``: a new folder)."""
    for argv in (["--help"], ["info", "--help"], ["demo", "--help"], ["parity", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        text = " ".join(capsys.readouterr().out.split())
        assert "``" not in text and "(default: None)" not in text and "(default: False)" not in text, (argv, text)
        if argv == ["--help"]:
            assert "info (backends and why), demo (a checked sharded run)" in text
        if argv[0] == "parity":
            assert "default: a new folder sp_kpool-parity-DATE-TIME" in text and "(default: fp8)" in text


def _rewritten(path, tmp_path, name, edit):
    """A copy of the capture ``path`` whose metadata ``edit(meta)`` changed (in place)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as fh:
        meta = dict(fh.metadata())
        tensors = {n: fh.get_tensor(n) for n in fh.keys()}
    edit(meta)
    out = tmp_path / name / path.name
    out.parent.mkdir()
    save_file(tensors, str(out), metadata=meta)
    return out


def _as_v1(*drop):
    """A metadata edit: the file made a ``sp_kpool.capture/1`` one, without the fields ``drop``."""

    def edit(meta):
        meta["format"] = "sp_kpool.capture/1"
        for k in drop:
            del meta[k]

    return edit


def test_each_format_version_loads_and_replays_alike(captured, tmp_path):
    """Files of every version the reader knows load and replay alike: ``/2`` (written now),
    ``/1`` with the ``config`` record (the last ``/1`` writers wrote what ``/2`` has),
    ``/1`` without it (the flat fields rebuild the config) and the oldest ``/1`` (no
    config, options, head gate, layout or versions). A field that ``/2`` always has is
    required in a ``/2`` file."""
    from sp_kpool.capture import FORMAT
    from sp_kpool.parity import FORMATS

    path, ids, m = captured[:3]
    assert FORMAT == "sp_kpool.capture/2" and list(FORMATS) == ["sp_kpool.capture/1", "sp_kpool.capture/2"]
    oldest = ("config", "options", "head_gate", "layout", "sp_kpool", "torch")
    files = {
        "sp_kpool.capture/2": path,
        "/1 with config": _rewritten(path, tmp_path, "v1-config", _as_v1()),
        "/1 without config": _rewritten(path, tmp_path, "v1-flat", _as_v1("config")),
        "/1 oldest": _rewritten(path, tmp_path, "v1-oldest", _as_v1(*oldest)),
    }
    want = m.config.resolve(m.settings, torch.device("cpu"))
    diffs = []
    for name, p in files.items():
        cap = load_capture(p)
        assert cap.meta["format"] == (FORMAT if name == FORMAT else "sp_kpool.capture/1"), name
        assert cap.config() == want and cap.options() == m.options and torch.equal(cap.ids, ids), name
        rep = replay(p, "fp8:torch", "bf16:torch", repeat=False)
        assert rep["arms"]["A"]["reproduces_captured_ids"] is True, name
        diffs.append(rep["diff"])
    assert all(d == diffs[0] for d in diffs[1:])
    meta = load_capture(files["/1 oldest"]).meta
    assert meta["config"] == {k: getattr(want, k) for k in meta["config"]}  # the flat fields
    assert (meta["layout"], meta["head_gate"], meta["options"], meta["sp_kpool"], meta["torch"]) == (
        "contiguous", "rounded to the parameter dtype", {}, "?", "?")  # fmt: skip
    for field in oldest:
        bad = _rewritten(path, tmp_path, f"v2-without-{field}", lambda meta: meta.pop(field))
        with pytest.raises(CaptureError, match=rf"without-{field}/.*: missing metadata \['{field}'\]"):
            load_capture(bad)


def test_an_unknown_format_version_is_refused_naming_it(captured, tmp_path, capsys):
    newer = _rewritten(captured[0], tmp_path, "newer", lambda meta: meta.update(format="sp_kpool.capture/3"))
    known = r"\['sp_kpool.capture/1', 'sp_kpool.capture/2'\]"
    with pytest.raises(CaptureError, match=rf"capture format 'sp_kpool.capture/3' is not one this reader knows "
                                           rf"\(it reads {known}\): written by a newer sp_kpool\?") as err:  # fmt: skip
        load_capture(newer)
    assert str(err.value).startswith(f"{newer}: ")
    assert main(["parity", str(newer), "--quiet"]) == 2 and f"error: {newer}: capture format" in capsys.readouterr().err
    other = _rewritten(captured[0], tmp_path, "other", lambda meta: meta.update(format="someone.else/2"))
    with pytest.raises(CaptureError, match=rf"not an sp_kpool capture \(metadata 'format' is 'someone.else/2', "
                                           rf"expected one of {known}\)"):  # fmt: skip
        load_capture(other)


def test_the_reader_stays_importable_from_sp_kpool_capture(captured):
    """The reader moved to ``sp_kpool.parity.load``; ``sp_kpool.capture`` still gives its
    names (loaded on first use), and the writer refuses metadata that would make a file
    that is not a whole ``/2`` one."""
    import sp_kpool.capture as capture_mod
    import sp_kpool.parity.load as load_mod

    for name in ("Capture", "load_capture", "load_capture_set"):
        assert getattr(capture_mod, name) is getattr(load_mod, name) and name in capture_mod.__all__
    assert capture_mod.CaptureError is load_mod.CaptureError
    with pytest.raises(AttributeError, match="module 'sp_kpool.capture' has no attribute 'load'"):
        capture_mod.load
    cap = load_capture(captured[0])
    seq = ShardedSequence.split(_cu(LENGTHS), world_size=1, rank=0)
    meta = {k: cap.meta[k] for k in capture_mod._CALLER_META if k not in ("config", "options", "head_gate")}
    with pytest.raises(ValueError, match=r"meta: expected every metadata field of sp_kpool.capture/2, missing "
                                         r"\['head_gate', 'config', 'options'\]"):  # fmt: skip
        capture_mod.write_capture(captured[0].parent / "unused.safetensors", hidden=cap.hidden, q_resid=cap.q_resid,
                                  ids=cap.ids, seq=seq, params=cap.params, meta=meta)  # fmt: skip


def test_the_config_round_trips_through_its_record(captured, tmp_path, monkeypatch):
    """The ``config`` record is rebuilt with ``KPoolConfig.from_record`` (a field added to
    the config survives the replay); a record that disagrees with the flat fields is
    refused, naming both."""
    import dataclasses
    import json

    import sp_kpool.config
    from sp_kpool.config import KPoolConfig

    path, _, m = captured[:3]
    want = m.config.resolve(m.settings, torch.device("cpu"))

    @dataclasses.dataclass(frozen=True)
    class Later(KPoolConfig):  # the config of a later version, with one field more
        later_field: int = 0

    def add_field(meta):
        meta["config"] = json.dumps({**json.loads(meta["config"]), "later_field": 7})

    later = _rewritten(path, tmp_path, "later", add_field)
    assert load_capture(later).config() == want  # today's config: the unknown field is ignored
    monkeypatch.setattr(sp_kpool.config, "KPoolConfig", Later)
    assert load_capture(later).config().later_field == 7  # rebuilt from the record, not field by field

    def disagree(meta):
        meta["config"] = json.dumps({**json.loads(meta["config"]), "alignment": 64})

    with pytest.raises(CaptureError, match=r"metadata 'config' disagrees with the flat metadata \(config vs flat\): "
                                           r"alignment: 64 vs 1"):  # fmt: skip
        load_capture(_rewritten(path, tmp_path, "disagree", disagree))
    with pytest.raises(CaptureError, match=r"metadata 'config': expected a JSON object, got '\[1\]'"):
        load_capture(_rewritten(path, tmp_path, "notjson", lambda meta: meta.update(config="[1]")))
