"""Capture a live indexer call to safetensors and read it back."""

import pytest
import torch

from sp_kpool import KPoolIndexer, ShardedSequence
from sp_kpool.capture import CaptureError, enable, load_capture

HIDDEN, Q_LORA, H, D, K, T = 32, 24, 8, 16, 4, 16  # D a power of two (fp8); H >= 8 (SPEC 10)
LENGTHS = [37, 22, 9]  # 68 tokens: partial pools, a document too short for a Top-K choice


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
    rebuilt = c.indexer("cpu")
    assert rebuilt._capture is None and all(torch.equal(rebuilt.state_dict()[n], state[n]) for n in state)


def test_environment_variable_turns_capture_on(tmp_path, monkeypatch):
    monkeypatch.setenv("SP_KPOOL_CAPTURE_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("SP_KPOOL_CAPTURE_CALLS", "2")
    m = _indexer("bf16")
    hidden, q_resid = _inputs(12)
    seq = ShardedSequence.split([0, 12], world_size=1, rank=0)
    for _ in range(3):
        m(hidden, q_resid, seq)
    names = sorted(p.name for p in (tmp_path / "env").glob("*.safetensors"))
    assert len(names) == 2 and "-call0000." in names[0] and "-call0001." in names[1]
    enable(m, None)
    assert m._capture is None
    monkeypatch.setenv("SP_KPOOL_CAPTURE_CALLS", "many")
    with pytest.raises(ValueError, match="SP_KPOOL_CAPTURE_CALLS: expected a non-negative integer, got 'many'"):
        _indexer("bf16")


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
def test_damaged_files_give_a_clear_error(captured, tmp_path, how, text):
    bad = _damaged(captured[0], tmp_path, how)
    with pytest.raises(CaptureError, match=text) as err:
        load_capture(bad)
    assert str(err.value).startswith(f"{bad}: ")


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
