"""GPU correctness checks of the GPU backends (formerly ``scripts/gpu_check.py``).

Every test here needs CUDA; without it each one is skipped (so CPU CI collects the folder
and reports it skipped). Run on a Hopper GPU host (H100/H200) with the package installed
(``pip install -e ".[test,tilelang,fp8,serving]"`` or the wheels of
``scripts/gpu_wheels.sh``), from the repository root::

    python -m pytest tests/gpu -q -rA --junitxml=$OUT/gpu.xml          # quick sizes
    SP_KPOOL_GPU_FULL=1 python -m pytest tests/gpu -q -rA --junitxml=$OUT/gpu.xml  # + full sizes
    python -m pytest tests/gpu -q -rA -m slow                           # only the full sizes
    python -m pytest tests/gpu/test_ranks.py -k deepgemm                # one module, one backend

The junit XML records every check (name = the check, pass/fail/skip with reason) and, as
properties of the test suite, the GPU and the versions of torch, CUDA and the optional
packages (also printed in the header); ``-rA`` prints the summary line of each. Sizes: the default is gpu_check's ``--quick``; the tests
marked ``slow`` are its full sizes (131072-token pools and exact case, 65536-token random
cases), run when ``SP_KPOOL_GPU_FULL=1`` is set or ``-m`` names ``slow``.

Optional packages: a test marked ``requires("tilelang")`` (``deep_gemm``, ``lmdeploy``,
``triton``) is skipped, naming the package, when that package is not installed at all
(``importlib.util.find_spec`` finds nothing). A package that is installed but fails to
import is a failure, not a skip. ``scripts/gpu_check.py`` failed its "lmdeploy
sparse_index_topk importable" check (and crashed the serving-order section) when lmdeploy
was missing; here those tests are skipped with the reason "lmdeploy not installed".
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))

#: package -> how to install it (the skip reason names both)
INSTALL = {
    "tilelang": "pip install 'sp-kpool[tilelang]'",
    "deep_gemm": "pip install 'sp-kpool[fp8]' (tokenspeed-deepgemm)",
    "lmdeploy": "pip install 'sp-kpool[serving]'",
    "triton": "pip install triton",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: full sizes of the GPU checks (SP_KPOOL_GPU_FULL=1 or -m slow)")
    config.addinivalue_line("markers", "requires(*packages): skipped when one of the packages is not installed")


def _full(config) -> bool:
    return os.environ.get("SP_KPOOL_GPU_FULL") == "1" or "slow" in (config.getoption("-m") or "")


def missing(*packages) -> list[str]:
    """The packages of ``packages`` that are not installed."""
    return [p for p in packages if importlib.util.find_spec(p) is None]


def pytest_collection_modifyitems(config, items):
    # a hook of this conftest sees the whole session's items: act on tests/gpu only
    mine = [it for it in items if str(it.path).startswith(HERE + os.sep)]
    if not mine:
        return
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="CUDA is not available (torch.cuda.is_available() is False): "
                                       "tests/gpu runs on a Hopper GPU host, see tests/gpu/conftest.py")  # fmt: skip
        for it in mine:
            it.add_marker(skip)
        return
    full = _full(config)
    for it in mine:
        if it.get_closest_marker("slow") and not full:
            it.add_marker(pytest.mark.skip(reason="full size: set SP_KPOOL_GPU_FULL=1 or pass -m slow"))
        need = [p for m in it.iter_markers("requires") for p in m.args]
        gone = missing(*need)
        if gone:
            it.add_marker(pytest.mark.skip(reason="; ".join(f"{p} not installed ({INSTALL.get(p, 'pip install ' + p)})"
                                                            for p in gone)))  # fmt: skip


def _versions() -> dict:
    from sp_kpool.bench.record import package_versions

    v = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        v["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except Exception as exc:  # noqa: BLE001 - the header must not break the run
        v["gpu"] = f"? ({type(exc).__name__})"
    return {**v, **package_versions(("triton", "tilelang", "deep_gemm", "lmdeploy"))}


def pytest_report_header(config, start_path):
    return "sp_kpool GPU tests: " + ", ".join(f"{k} {v}" for k, v in _versions().items())


@pytest.fixture(scope="session", autouse=True)
def _record_versions(record_testsuite_property):
    for k, v in _versions().items():
        record_testsuite_property(k, str(v))


@pytest.fixture(scope="module")
def cache():
    """A dict kept for one module (outputs shared by several checks of the same run), freed
    with the module's CUDA memory at its end."""
    d: dict = {}
    yield d
    d.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
