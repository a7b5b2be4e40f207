"""examples/transformers_glm5.py runs (CPU) and passes its own self-check."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers.models.glm5_next", reason="needs transformers with glm5_next (the 'test' extra)")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "transformers_glm5.py"


def test_example_passes(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", "1")  # tiny matrices: one thread is fastest
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--seq", "24"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = proc.stdout.splitlines()
    assert lines[-1] == "PASS", out
    assert "logits (3, 24, 97): bitwise equal True" in proc.stdout, out


def test_example_reports_failure(capsys):
    # the self-check can fail: another selection (a perturbed indexer weight) prints FAIL
    # (in this process: the subprocess run above is the one CI needs)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert _run_in_process(["--seq", "24", "--perturb"]) == 1
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("FAIL: ") and "logits differ" in out


def _run_in_process(argv):
    spec = importlib.util.spec_from_file_location("transformers_glm5_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.main(argv)
