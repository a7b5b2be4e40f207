"""The framework examples run as scripts (what a user runs; CI runs them here).

Each spawns its gloo ranks, runs the adapter, checks every rank against world size 1 and
prints PASS/FAIL; ``--inject-fault`` corrupts one id, and the self-check must then fail.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.xdist_group("ranks")


def _run(script, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)  # fmt: skip


@pytest.mark.parametrize("script, name, world_size", [
    ("xtuner_sp.py", "xtuner_sp", 2), ("xtuner_sp.py", "xtuner_sp", 4),
    ("megatron_cp.py", "megatron_cp", 2),
])  # fmt: skip
def test_example_passes(script, name, world_size):
    out = _run(script, "--world-size", str(world_size))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{name} world_size={world_size} device=cpu: PASS" in out.stdout, out.stdout
    assert out.stdout.count(" PASS") >= world_size + 1 and "FAIL" not in out.stdout, out.stdout


@pytest.mark.parametrize("script, name", [("xtuner_sp.py", "xtuner_sp"), ("megatron_cp.py", "megatron_cp")])
def test_example_self_check_can_fail(script, name):
    out = _run(script, "--world-size", "2", "--inject-fault")
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"{name} world_size=2 device=cpu: FAIL" in out.stdout, out.stdout


@pytest.mark.parametrize("script, flag, world_size", [
    ("xtuner_sp.py", "--replay", 4), ("megatron_cp.py", "--replay", 2),
    ("xtuner_sp.py", "--train", 3), ("megatron_cp.py", "--train", 2),
])  # fmt: skip
def test_example_variant_passes_and_can_fail(script, flag, world_size):
    """``--replay``: a rollout-shaped capture replayed bit for bit; ``--train``: the indexer's
    KL loss on the framework's layout, gradients equal world size 1's. Each fails with
    ``--inject-fault``."""
    name = f"{script.removesuffix('.py')} {flag}"
    out = _run(script, "--world-size", str(world_size), flag)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{name} world_size={world_size} device=cpu: PASS" in out.stdout, out.stdout
    assert "FAIL" not in out.stdout, out.stdout
    out = _run(script, "--world-size", "2", flag, "--inject-fault")
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"{name} world_size=2 device=cpu: FAIL" in out.stdout, out.stdout
