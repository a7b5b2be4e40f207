"""sp_kpool.backends.deepgemm_api: the DeepGEMM API generation detected from the module (CPU,
with the stand-ins of :mod:`sp_kpool.testing.standins`): which function, which column
layouts, the call form of each generation (bit for bit the stand-in's direct call), the
version line ``info`` prints, and the backend's ``mqa_api`` following the same rule."""

from __future__ import annotations

import types

import pytest
import torch

from sp_kpool.backends import deepgemm_api, deepgemm_backend
from sp_kpool.testing.standins import fake_deep_gemm, fp8_mqa_logits


@pytest.mark.parametrize("api, generation, layouts, fused", [
    ("fp8", "fp8_mqa_logits", ("legacy", "compact"), False),  # 2.5 with max_seqlen_k
    ("fp8-legacy", "fp8_mqa_logits", ("legacy",), False),  # an older 2.5 build
    ("fp8_fp4", "fp8_fp4_mqa_logits", ("compact",), True),  # 2.6 and later
])  # fmt: skip
def test_generation_and_layouts(api, generation, layouts, fused):
    got = deepgemm_api.from_module(fake_deep_gemm(api))
    assert (got.generation, got.layouts, got.fused_clean, got.version) == (generation, layouts, fused, "stand-in")
    assert got.function.__name__ == generation


def test_both_functions_prefer_fp8_mqa_logits_and_neither_is_an_error():
    mod = fake_deep_gemm("fp8")
    mod.fp8_fp4_mqa_logits = fake_deep_gemm("fp8_fp4").fp8_fp4_mqa_logits
    assert deepgemm_api.from_module(mod).generation == "fp8_mqa_logits"
    with pytest.raises(RuntimeError, match="has neither fp8_mqa_logits nor fp8_fp4_mqa_logits"):
        deepgemm_api.from_module(types.ModuleType("deep_gemm"))


def test_max_seqlen_k_read_from_the_docstring_of_a_compiled_function():
    class Builtin:  # no inspectable signature, as a pybind function
        __doc__ = "fp8_mqa_logits(q, kv, weights, ks, ke, clean_logits: bool = True, max_seqlen_k: int = 0)"
        __signature__ = property(lambda self: (_ for _ in ()).throw(ValueError("no signature")))

        def __call__(self, *a, **k):
            raise AssertionError

    mod = types.ModuleType("deep_gemm")
    mod.fp8_mqa_logits = Builtin()
    assert deepgemm_api.from_module(mod).layouts == ("legacy", "compact")


def _inputs(R=5, N=11, H=32, D=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    q8 = (torch.randn(R, H, D, generator=g) * 4).to(torch.float8_e4m3fn)
    k8 = (torch.randn(N, D, generator=g) * 4).to(torch.float8_e4m3fn)
    ks = torch.tensor([0, 0, 2, 3, 4][:R], dtype=torch.int32)
    ke = torch.tensor([1, 4, 7, 9, 11][:R], dtype=torch.int32)
    return q8, (k8, torch.rand(N, generator=g)), torch.rand(R, H, generator=g), ks, ke


@pytest.mark.parametrize("api, layout", [("fp8", "legacy"), ("fp8", "compact"), ("fp8-legacy", "legacy"),
                                         ("fp8_fp4", "compact")])  # fmt: skip
def test_call_form_of_each_generation(api, layout):
    q8, kv, w, ks, ke = _inputs()
    m = int((ke - ks).max()) if layout == "compact" else 0
    got = deepgemm_api.from_module(fake_deep_gemm(api)).score(q8, kv, w, ks, ke, layout=layout, clean=False,
                                                               max_seqlen_k=m)  # fmt: skip
    want = fp8_mqa_logits(q8, kv, w, ks, ke, False, m)
    assert got.shape == want.shape and torch.equal(got, want)


def test_unsupported_layout_names_the_generation():
    q8, kv, w, ks, ke = _inputs()
    with pytest.raises(ValueError, match=r"fp8_fp4_mqa_logits\) supports \['compact'\], not 'legacy'"):
        deepgemm_api.from_module(fake_deep_gemm("fp8_fp4")).score(q8, kv, w, ks, ke, layout="legacy", clean=True)


def test_backend_mqa_api_follows_the_same_rule(monkeypatch):
    for api in ("fp8", "fp8-legacy", "fp8_fp4"):
        fake = fake_deep_gemm(api)
        monkeypatch.setattr(deepgemm_backend, "probe", lambda m, fake=fake: (fake, None))
        fn, layouts = deepgemm_backend.mqa_api.__wrapped__()
        want = deepgemm_api.from_module(fake)
        assert fn is want.function and layouts == want.layouts


def test_version_and_describe(monkeypatch):
    from importlib import metadata

    versions = {"tokenspeed-deepgemm": "2.5.0.post20260810"}

    def version(dist):
        if dist in versions:
            return versions[dist]
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(metadata, "version", version)
    assert deepgemm_api.installed_version() == "tokenspeed-deepgemm 2.5.0.post20260810"
    real = deepgemm_api.from_module(fake_deep_gemm("fp8"))
    monkeypatch.setattr(deepgemm_api, "detect", lambda: real)
    assert deepgemm_api.describe() == "stand-in: API fp8_mqa_logits (legacy, compact columns)"

    def broken():
        raise RuntimeError("deep_gemm not importable (ImportError: undefined symbol c10::ValueError)")

    monkeypatch.setattr(deepgemm_api, "detect", broken)
    assert deepgemm_api.describe() == ("unavailable: tokenspeed-deepgemm 2.5.0.post20260810 installed; deep_gemm not "
                                       "importable (ImportError: undefined symbol c10::ValueError)")  # fmt: skip
    versions.clear()
    assert deepgemm_api.installed_version(types.SimpleNamespace(__version__="2.8.0")) == "deep_gemm 2.8.0"
    assert deepgemm_api.installed_version() is None


def test_info_prints_the_deepgemm_version_and_api(monkeypatch, capsys):
    from sp_kpool import cli

    api = deepgemm_api.from_module(fake_deep_gemm("fp8_fp4"))
    monkeypatch.setattr(deepgemm_api, "detect", lambda: api)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "DeepGEMM: stand-in: API fp8_fp4_mqa_logits (compact columns; the kernel can clean them" in out, out
    assert "[fp8-torch214] = 2.8.2, pins torch==2.14.0" in out
