"""Bad input: clear errors naming the argument, expected and actual value."""

import pytest
import torch

from sp_kpool import KPoolIndexer, ShardedSequence, kpool_topk
from sp_kpool.testing.problems import make_inputs, shard_inputs


def _args(S=23, world_size=1, rank=0):
    x = make_inputs([S], heads=8, head_dim=16, kpool=4, seed=0)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=world_size, rank=rank)
    return shard_inputs(x, seq), seq


def _bad(fn):
    args, seq = _args()
    kw = dict(topk=8, kpool=4)
    fn(args, kw)
    return args, seq, kw


CASES = [
    (lambda a, k: a.update(q=a["q"][0]), ValueError, "q: expected shape [*, *, *], got [8, 16]"),
    (lambda a, k: a.update(q=a["q"][:-1]), ValueError, "q: expected 23 local rows"),
    (lambda a, k: a.update(k=a["k"][:, :8]), ValueError, "k: expected shape [23, 16] (rows: seq.shard_size; D: q.shape[2], gates.shape[1], ape.shape[1]), got [23, 8]"),
    (lambda a, k: a.update(gates=a["gates"][:5]), ValueError, "gates: expected shape [23, 16] (rows: seq.shard_size; D: q.shape[2], k.shape[1], ape.shape[1]), got [5, 16]"),
    (lambda a, k: a.update(head_weights=a["head_weights"][:, :4]), ValueError, "head_weights: expected shape [23, 8] (rows: seq.shard_size; H: q.shape[1]), got [23, 4]"),
    (lambda a, k: a.update(ape=a["ape"][:3]), ValueError, "ape: expected shape [4, 16] (rows: kpool; D: q.shape[2], k.shape[1], gates.shape[1]), got [3, 16]"),
    (lambda a, k: a.update(k=a["k"].to(torch.int64)), TypeError, "k: expected a floating-point dtype, got torch.int64"),
    # q of another head dim than k, gates and ape is a q error (the majority sets D)
    (lambda a, k: a.update(q=torch.cat([a["q"], a["q"]], 2)), ValueError,
     "q: expected shape [23, 8, 16] (D: k.shape[1], gates.shape[1], ape.shape[1]), got [23, 8, 32]"),
    (lambda a, k: a.update(ape=a["ape"][:, :8]), ValueError, "ape: expected shape [4, 16] (rows: kpool; D: q.shape[2], k.shape[1], gates.shape[1]), got [4, 8]"),
    # mixed dtypes (docs/contract.md section 11): q and k share one; gates, ape, head_weights any float
    (lambda a, k: a.update(q=a["q"].bfloat16()), TypeError,
     "k: expected dtype torch.bfloat16 (the dtype of q; q and k meet in the scores: cast one of them), got torch.float32"),
    (lambda a, k: a.update(q=a["q"].numpy()), TypeError, "q: expected a torch.Tensor, got ndarray"),
    (lambda a, k: a.update(k=a["k"].to("meta")), ValueError, "k: expected device cpu (the device of q), got meta"),
    (lambda a, k: k.update(topk=10), ValueError, "topk: expected a multiple of kpool = 4, got 10"),
    (lambda a, k: k.update(kpool=0), ValueError, "kpool: expected >= 1, got 0"),
    (lambda a, k: k.update(topk=0), ValueError, "topk: expected >= 1, got 0"),
    (lambda a, k: k.update(tail="end"), ValueError, "tail: expected one of ['fixed', 'compact'], got 'end'"),
    (lambda a, k: k.update(order="random"), ValueError, "order: expected one of ['ascending', 'score', 'serving', 'ascending-unused-first'], got 'random'"),
    (lambda a, k: k.update(order="serving"), ValueError, "order 'serving' needs the CUDA serving selector, inputs are on cpu"),
    (lambda a, k: k.update(alignment=0), ValueError, "alignment: expected >= 1, got 0"),
    (lambda a, k: k.update(backend="cuda-magic"), ValueError, "backend: expected one of ['auto', 'torch'"),
    (lambda a, k: k.update(max_logits_bytes=10), ValueError, "max_logits_bytes: expected at least"),
]


@pytest.mark.parametrize("mutate, exc, text", CASES)
def test_bad_input_is_named(mutate, exc, text):
    args, seq, kw = _bad(mutate)
    with pytest.raises(exc) as info:
        kpool_topk(**args, seq=seq, **kw)
    assert text in str(info.value)


def test_seq_must_be_a_sharded_sequence():
    args, _ = _args()
    with pytest.raises(TypeError, match="seq: expected a ShardedSequence, got list"):
        kpool_topk(**args, seq=[0, 23], topk=8)


def test_cu_seq_lens_not_matching_the_data():
    args, _ = _args(S=23)
    seq = ShardedSequence.split([0, 30], world_size=1, rank=0)
    with pytest.raises(ValueError, match="q: expected 30 local rows"):
        kpool_topk(**args, seq=seq, topk=8)


def test_env_budget_is_validated(monkeypatch):
    from sp_kpool.settings import Settings, current_settings

    with pytest.raises(ValueError, match="SP_KPOOL_MAX_LOGITS_BYTES: expected a positive integer"):
        Settings.from_env({"SP_KPOOL_MAX_LOGITS_BYTES": "lots"})
    # the process settings are read at the first call that needs them
    args, seq = _args()
    monkeypatch.setenv("SP_KPOOL_MAX_LOGITS_BYTES", "lots")
    current_settings.cache_clear()
    try:
        with pytest.raises(ValueError, match="SP_KPOOL_MAX_LOGITS_BYTES: expected a positive integer"):
            kpool_topk(**args, seq=seq, topk=8)
    finally:
        current_settings.cache_clear()


def test_indexer_rejects_bad_config_and_inputs():
    with pytest.raises(ValueError, match="index_topk: expected a multiple of index_kpool = 4, got 10"):
        KPoolIndexer(hidden_size=8, q_lora_rank=4, index_n_heads=2, index_head_dim=4, index_topk=10)
    with pytest.raises(ValueError, match="index_n_heads: expected >= 1, got 0"):
        KPoolIndexer(hidden_size=8, q_lora_rank=4, index_n_heads=0, index_head_dim=4, index_topk=8)
    m = KPoolIndexer(hidden_size=8, q_lora_rank=4, index_n_heads=2, index_head_dim=4, index_topk=8)
    seq = ShardedSequence.split([0, 5], world_size=1, rank=0)
    with pytest.raises(ValueError, match=r"hidden: expected shape \[S_local, 8\], got \[5, 7\]"):
        m(torch.zeros(5, 7), torch.zeros(5, 4), seq)
    with pytest.raises(ValueError, match="q_resid: expected 5 rows"):
        m(torch.zeros(5, 8), torch.zeros(4, 4), seq)


# --------------------------------------------------------------------------- reliability


def test_integer_like_values_are_accepted_and_give_the_same_rows():
    import numpy as np

    args, seq = _args()
    ref = kpool_topk(**args, seq=seq, topk=8, kpool=4)
    seq_np = ShardedSequence.split(np.array([0, 23]), world_size=np.int64(1), rank=np.int32(0))
    for kw in (dict(topk=np.int64(8), kpool=np.int32(4)), dict(topk=torch.tensor(8), kpool=4, alignment=np.uint8(1))):
        assert torch.equal(kpool_topk(**args, seq=seq_np, **kw), ref)
    for bad, text in ((np.float64(8), "topk: expected int, got np.float64(8.0)"), (np.bool_(True), "topk: expected int"),
                      (torch.tensor([8]), "topk: expected int")):  # fmt: skip
        with pytest.raises(TypeError, match=text.replace("(", r"\(").replace(")", r"\)")):
            kpool_topk(**args, seq=seq, topk=bad)
    with pytest.raises(TypeError, match="cu_seq_lens: expected an integer array, got dtype float64"):
        ShardedSequence.split(np.array([0.0, 23.0]), world_size=1, rank=0)


def test_check_finite_names_the_tensor_row_and_value():
    from sp_kpool.settings import Settings

    for name, idx, row in (("q", (5, 1, 2), r"local row 5 \(stream position 5\) on rank 0"), ("k", (7, 0), "local row 7"),
                           ("gates", (3, 3), "local row 3"), ("head_weights", (9, 2), "local row 9"),
                           ("ape", (2, 1), "slot 2")):  # fmt: skip
        for value in (float("nan"), float("inf"), -float("inf")):
            args, seq = _args()
            args[name][idx] = value
            kpool_topk(**args, seq=seq, topk=8)  # off by default: no error (the rows lose ids, see the contract)
            with pytest.raises(ValueError, match=f"{name}: expected finite values \\(check_finite\\), got {value} in {row}"):
                kpool_topk(**args, seq=seq, topk=8, check_finite=True)
            with pytest.raises(ValueError, match=f"{name}: expected finite values"):  # the settings' default
                kpool_topk(**args, seq=seq, topk=8, settings=Settings.from_env({"SP_KPOOL_CHECK_FINITE": "1"}))
            kpool_topk(**args, seq=seq, topk=8, check_finite=False, settings=Settings(check_finite=True))


def test_padding_rows_are_not_checked_for_finite_values():
    x = make_inputs([5], heads=8, head_dim=16, kpool=4, seed=0)
    seq = ShardedSequence.split(x.cu_seq_lens, world_size=4, rank=3)  # rows 6, 7: padding only
    args = shard_inputs(x, seq)
    args["k"].fill_(float("nan"))
    from sp_kpool.agreement import _check_finite

    _check_finite(args, seq)  # nothing real on this rank


def test_absurd_topk_is_refused_before_any_allocation():
    args, seq = _args()
    with pytest.raises(ValueError, match=r"topk: expected at most the longest document \(23 tokens\) for an output "
                                         r"this large, got 268435456: the output \[23, 268435459\] int32"):  # fmt: skip
        kpool_topk(**args, seq=seq, topk=2**28)
    with pytest.raises(ValueError, match="topk: expected <= 2147483644, got 8589934592"):
        kpool_topk(**args, seq=seq, topk=2**33)
    assert kpool_topk(**args, seq=seq, topk=4096).shape == (23, 4099)  # beyond the document, not absurd


def test_the_error_type_is_the_same_at_world_size_one():
    # a TypeError of a local check stays a TypeError (with several ranks too: test_faults)
    args, seq = _args()
    with pytest.raises(TypeError, match="seq: expected a ShardedSequence"):
        kpool_topk(**args, seq=[0, 23], topk=8)
    with pytest.raises(TypeError, match="stats: expected a dict or None, got list"):
        kpool_topk(**args, seq=seq, topk=8, stats=[])


def test_seq_inconsistent_with_its_process_group():
    args, seq = _args()
    two = ShardedSequence.split([0, 23], world_size=2, rank=0)
    x = make_inputs([23], heads=8, head_dim=16, kpool=4, seed=0)
    with pytest.raises(ValueError, match="seq: world size 2 .* needs an initialized torch.distributed process group"):
        kpool_topk(**shard_inputs(x, two), seq=two, topk=8)
    import dataclasses

    shifted = dataclasses.replace(seq, shard_start=3)
    with pytest.raises(ValueError, match="seq: expected shard_start = rank \\* shard_size"):
        kpool_topk(**args, seq=shifted, topk=8)


def test_settings_keep_an_unreadable_variable_for_the_agreement():
    from sp_kpool.settings import Settings

    s = Settings.from_env({"SP_KPOOL_COMM_TIMEOUT": "soon", "SP_KPOOL_PRECISION": "fp8"}, strict=False)
    assert s.precision == "fp8" and s.comm_timeout == 600.0
    assert s.env_error == "SP_KPOOL_COMM_TIMEOUT: expected a positive number of seconds, got 'soon'"
    with pytest.raises(ValueError, match="SP_KPOOL_COMM_TIMEOUT: expected a positive number of seconds, got 'soon'"):
        Settings.from_env({"SP_KPOOL_COMM_TIMEOUT": "soon"})
    args, seq = _args()
    with pytest.raises(ValueError, match="SP_KPOOL_COMM_TIMEOUT: expected a positive number"):
        kpool_topk(**args, seq=seq, topk=8, settings=s)
    assert Settings.from_env({"SP_KPOOL_COMM_TIMEOUT": "2.5", "SP_KPOOL_CHECK_FINITE": "1"}) == Settings(
        comm_timeout=2.5, check_finite=True)  # fmt: skip
    rows = {var: value for var, value, _ in Settings().describe()}
    assert rows["SP_KPOOL_COMM_TIMEOUT"] == "600.0" and rows["SP_KPOOL_CHECK_FINITE"] == "0"


def test_info_says_a_variable_is_invalid_not_its_default(monkeypatch, capsys):
    """``info`` lists SP_KPOOL_COMM_TIMEOUT=10s as invalid with its error (every operator
    call raises it), not as the default that stands in for it."""
    from sp_kpool.cli import main
    from sp_kpool.settings import Settings, current_settings

    s = Settings.from_env({"SP_KPOOL_COMM_TIMEOUT": "10s", "SP_KPOOL_PRECISION": "fp8"}, strict=False)
    rows = {var: (value, source) for var, value, source in s.describe()}
    assert rows["SP_KPOOL_COMM_TIMEOUT"] == (
        "invalid", "expected a positive number of seconds, got '10s' (every operator call raises this)")
    assert rows["SP_KPOOL_PRECISION"] == ("fp8", "set") and rows["SP_KPOOL_FUSED"] == ("0", "default")
    monkeypatch.setenv("SP_KPOOL_COMM_TIMEOUT", "10s")
    current_settings.cache_clear()
    try:
        assert main(["info"]) == 0
    finally:
        current_settings.cache_clear()  # the next test reads the environment without the bad value
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("SP_KPOOL_COMM_TIMEOUT"))
    assert "invalid" in line and "got '10s'" in line and "600" not in line and "default" not in line, line


def test_indexer_validates_options_and_capture_dir_at_construction(tmp_path):
    kw = dict(hidden_size=8, q_lora_rank=4, index_n_heads=2, index_head_dim=4, index_topk=8)
    for bad, text in ((dict(backend="nope"), "backend: expected one of"), (dict(tail="nope"), "tail: expected one of"),
                      (dict(gather="all"), "gather: expected one of"), (dict(check_finite="yes"), "check_finite: ")):
        with pytest.raises((TypeError, ValueError), match=text):
            KPoolIndexer(**kw, **bad)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="capture_dir: expected a writable directory, got .*file/sub"):
        KPoolIndexer(**kw, capture_dir=str(blocker / "sub"))
    KPoolIndexer(**kw, capture_dir=str(tmp_path / "new" / "dir"))
    assert (tmp_path / "new" / "dir").is_dir()


def test_indexer_names_hidden_and_q_resid_on_dtype_or_device():
    m = KPoolIndexer(hidden_size=8, q_lora_rank=4, index_n_heads=2, index_head_dim=4, index_topk=8, dtype=torch.bfloat16)
    seq = ShardedSequence.split([0, 5], world_size=1, rank=0)
    bf = dict(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"hidden: expected dtype torch.bfloat16 \(the parameters' dtype"):
        m(torch.zeros(5, 8), torch.zeros(5, 4, **bf), seq)
    with pytest.raises(ValueError, match=r"q_resid: expected dtype torch.bfloat16"):
        m(torch.zeros(5, 8, **bf), torch.zeros(5, 4, dtype=torch.float16), seq)
    with pytest.raises(ValueError, match=r"hidden: expected device cpu \(the parameters' device\), got meta"):
        m(torch.zeros(5, 8, device="meta", **bf), torch.zeros(5, 4, **bf), seq)
    with pytest.raises(TypeError, match="hidden: expected a torch.Tensor, got list"):
        m([[0.0] * 8] * 5, torch.zeros(5, 4, **bf), seq)
    assert m(torch.zeros(5, 8, **bf), torch.zeros(5, 4, **bf), seq).shape == (5, 11)


@pytest.mark.parametrize("argv, flag", [
    (["demo", "--world-size", "0"], "--world-size"),
    (["demo", "--docs", "0"], "--docs"),
    (["demo", "--tokens", "0"], "--tokens"),
    (["demo", "--tokens", "4", "--docs", "5"], "--docs"),
    (["demo", "--kpool", "3"], "--topk"),
    (["demo", "--heads", "x"], "--heads"),
    (["demo", "--timeout", "0"], "--timeout"),
    (["demo", "--layout", "stripe"], "--layout"),
    (["info", "--head-dim", "-1"], "--head-dim"),
    (["parity", "--a", "int4"], "--a"),
    (["parity", "--synthetic", "--world-size", "2", "--rank", "2"], "--rank"),
    (["parity", "--synthetic", "--prompt-fraction", "1.5"], "--prompt-fraction"),
    (["parity", "--synthetic", "--capture-precision", "fp16"], "--capture-precision"),
])  # fmt: skip
def test_cli_flags_are_validated(argv, flag, capsys):
    from sp_kpool.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


def test_mixed_dtypes_gates_ape_and_head_weights_are_taken_in_fp32():
    """The rule of docs/contract.md section 11: q and k share a dtype (else TypeError, above);
    gates, ape and head_weights may have any float dtype and are taken in FP32, so FP32
    copies of BF16 values give the same ids as the BF16 tensors themselves."""
    args, seq = _args()
    bf = {name: t.bfloat16() for name, t in args.items()}
    mixed = {**bf, **{name: bf[name].float() for name in ("gates", "ape", "head_weights")}}
    assert torch.equal(kpool_topk(**mixed, seq=seq, topk=8, kpool=4), kpool_topk(**bf, seq=seq, topk=8, kpool=4))


def test_indexer_bf16_under_autocast_scores_q_and_k_in_one_dtype():
    m = KPoolIndexer(hidden_size=8, q_lora_rank=4, index_n_heads=2, index_head_dim=4, index_topk=8, precision="bf16")
    seq = ShardedSequence.split([0, 9], world_size=1, rank=0)
    hidden, q_resid = torch.randn(9, 8), torch.randn(9, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        prepared = m.prepare(hidden, q_resid)
        assert prepared["q"].dtype == prepared["k"].dtype == torch.bfloat16
        assert m(hidden, q_resid, seq).shape == (9, 8 + 4 - 1)


@pytest.mark.parametrize("script", ["examples/xtuner_sp.py", "examples/megatron_cp.py", "examples/transformers_glm5.py",
                                    "parity"])  # fmt: skip
def test_device_cuda_without_cuda_is_an_error_of_the_flag(script, monkeypatch, capsys):
    """``--device cuda`` on a host without CUDA: an argparse error of ``--device`` (exit 2)
    in every command and example, before any rank starts (not a ZeroDivisionError in a
    rank, not a torch traceback)."""
    import importlib.util
    import os

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if script == "parity":
        from sp_kpool.cli import main
    else:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        spec = importlib.util.spec_from_file_location("example_under_test", os.path.join(root, script))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        main = module.main
    for value in ("cuda", "cuda:1"):
        with pytest.raises(SystemExit) as info:
            main((["parity", "--synthetic"] if script == "parity" else []) + ["--device", value])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"argument --device: expected a device this host has, got '{value}': CUDA is not available here" in err


def test_run_ranks_on_nccl_without_cuda_names_the_backend(monkeypatch):
    from sp_kpool.testing.dist import run_ranks

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="backend: 'nccl' needs CUDA GPUs, and CUDA is not available"):
        run_ranks(print, 2, backend="nccl")


def test_device_flag_names_a_bad_device():
    from sp_kpool._device import check_device

    with pytest.raises(ValueError, match=r"--device: expected one of \['cpu', 'cuda', 'cuda:N'\], got 'gpu'"):
        check_device("--device", "gpu")
    assert check_device("--device", "cpu") == "cpu" and check_device("--device", "auto", auto=True) == "auto"
