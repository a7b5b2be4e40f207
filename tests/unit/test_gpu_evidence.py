"""``scripts/gpu_evidence.sh`` on a CPU: its syntax, its usage errors, and the steps of every
part as ``--dry-run`` lists them (which runs and writes nothing), so that a broken script fails
here rather than in a GPU lease.

- every part: its steps are named (by what they measure), and every benchmark step calls a
  case of ``python3 -m sp_kpool.bench`` with options that case accepts (parsed here: a GPU case
  parses its options, then stops at its CUDA check).

- ``cudasmoke``: the build, the SASS, then every variant of
  :data:`sp_kpool.testing.cuda_smoke.VARIANTS` in its own process under ``timeout 60``.
- ``cudatests``: every test function of ``tests/gpu/test_cuda_fp8_mqa.py`` but the smoke in
  its own pytest process, without ``-x``, each test under pytest-timeout (which the GPU wheel
  set carries: ``scripts/gpu_wheels.sh``).
- ``cudabench``: the benchmark (``bench cuda-scorer``) behind the gate on the smoke record.
- ``cuda``: the three in that order.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sp_kpool.testing.cuda_smoke import VARIANTS

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_evidence.sh"
TESTS = ROOT / "tests" / "gpu" / "test_cuda_fp8_mqa.py"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and timeout")  # fmt: skip


def _run(*args: str) -> subprocess.CompletedProcess:
    # python3 on PATH is this interpreter's (the script runs `python3 -m sp_kpool.testing.cuda_smoke --list`)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    if not (Path(sys.executable).parent / "python3").exists():
        pytest.skip("no python3 next to this interpreter")
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _steps(part: str, out: Path) -> list[tuple[str, str]]:
    done = _run("--dry-run", part, str(out))
    assert done.returncode == 0, done.stderr
    assert not out.exists()  # nothing written
    steps = [tuple(line.split(": ", 1)) for line in done.stdout.splitlines()]
    assert all(len(s) == 2 for s in steps), done.stdout
    return steps


def test_syntax():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("args,message", [
    ((), "usage: "),
    (("cuda",), "usage: "),
    (("nopart", "out"), "unknown part: nopart"),
    (("--dry-run", "nopart", "out"), "unknown part: nopart"),
])  # fmt: skip
def test_usage_errors(args, message):
    done = _run(*args)
    assert done.returncode == 2 and message in done.stderr, (done.stdout, done.stderr)
    assert not (ROOT / "out").exists()  # refused before anything is written


def test_smoke_steps_run_each_variant_alone_under_a_short_limit(tmp_path):
    steps = _steps("cudasmoke", tmp_path / "ev")
    assert [name for name, _ in steps[:2]] == ["cuda_build", "cuda_sass"]
    assert steps[2:] == [(f"cuda_smoke/{v}", f"timeout 60 python3 -m sp_kpool.testing.cuda_smoke {v}")
                         for v in VARIANTS]  # fmt: skip
    # every variant the kernel has: H 32/64/128 x q_blocks 1/2 x dense/no-store x fp8/bf16
    assert len(VARIANTS) == 24 and len(set(VARIANTS)) == 24


def test_test_steps_run_each_function_alone_without_x_under_pytest_timeout(tmp_path):
    out = tmp_path / "ev"
    steps = _steps("cudatests", out)
    functions = re.findall(r"^def (test_\w+)", TESTS.read_text(), re.M)
    want = [f for f in functions if f != "test_smoke_of_the_debug_build"]  # the smoke steps run it, one per process
    assert [name for name, _ in steps] == [f"cuda_tests/{f}" for f in want] and len(want) >= 5
    for (name, cmd), f in zip(steps, want):
        args = cmd.split()
        assert args[:6] == ["timeout", "300", "python3", "-m", "pytest", f"tests/gpu/test_cuda_fp8_mqa.py::{f}"]
        assert "-x" not in args and "--exitfirst" not in args
        assert "--timeout" in args and "--timeout-method=thread" in args
        assert f"--junitxml={out}/cuda_tests/{f}.xml" in args


def test_bench_runs_behind_the_smoke_gate(tmp_path):
    out = tmp_path / "ev"
    steps = _steps("cudabench", out)
    assert [name for name, _ in steps] == ["gate", "cuda_scorer_time"]
    assert f"{out}/cuda_smoke.txt says pass" in steps[0][1]
    assert steps[1][1].startswith("timeout 300 python3 -m sp_kpool.bench cuda-scorer ")
    whole = [name for name, _ in _steps("cuda", out)]
    assert whole == ["cuda_build", "cuda_sass", *[f"cuda_smoke/{v}" for v in VARIANTS],
                     *[n for n, _ in _steps("cudatests", out)], "gate", "cuda_scorer_time"]  # fmt: skip


#: every part, and the benchmark cases its steps run (``python3 -m sp_kpool.bench CASE``)
PARTS = {"check": ["kernels"], "ranks": [], "scale": ["e2e", "e2e"], "perf": ["kernels", "e2e", "e2e"],
         "chunks": ["budget", "budget"], "cudabench": ["cuda-scorer"], "cudawhole": ["budget"],
         "cudancu": ["cuda-scorer"]}  # fmt: skip


@pytest.mark.parametrize("part", sorted(PARTS))
def test_every_part_lists_named_steps_that_call_the_bench_entry(part, tmp_path, capsys):
    from sp_kpool.bench import cli as bench
    from sp_kpool.bench import e2e

    steps = _steps(part, tmp_path / "ev")
    names = [name for name, _ in steps]
    assert names and len(set(names)) == len(names) and all(re.fullmatch(r"[A-Za-z0-9_./-]+", n) for n in names), names
    assert not any("scripts/bench" in cmd for _, cmd in steps)  # the old scripts are gone
    cases = []
    for _, cmd in steps:
        args = cmd.split()
        if "sp_kpool.bench" not in args:
            continue
        case, rest = args[args.index("sp_kpool.bench") + 1], args[args.index("sp_kpool.bench") + 2 :]
        cases.append(case)
        assert case in bench.CASES, cmd
        if case == "e2e":  # a CPU case: parse its options only
            e2e.parse_args(rest)
            continue
        assert bench.CASES[case][1], case  # a GPU case: its options parse, then its CUDA check stops it
        with pytest.raises(SystemExit) as exc:
            bench.main([case, *rest])
        assert "needs a CUDA GPU" in str(exc.value.code), (cmd, exc.value.code, capsys.readouterr().err)
    assert cases == PARTS[part]


def test_the_gpu_wheel_set_carries_pytest_timeout():
    text = (ROOT / "scripts" / "gpu_wheels.sh").read_text()
    assert re.search(r'"pytest-timeout==[\d.]+"', text)


def test_smoke_variant_names():
    import torch

    from sp_kpool.testing import cuda_smoke

    assert cuda_smoke.parse("h128-qb2-nostore-bf16") == (128, 2, "nostore", torch.bfloat16)
    assert cuda_smoke.parse("h32-qb1-dense-fp8") == (32, 1, "dense", torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="variant: expected one of h32-qb1-dense-fp8, .*; got 'h48-qb1-dense-fp8'"):
        cuda_smoke.parse("h48-qb1-dense-fp8")
    with pytest.raises(SystemExit) as exc:
        cuda_smoke.main(["h48-qb1-dense-fp8"])  # a usage error, not a smoke result
    assert exc.value.code == 2
