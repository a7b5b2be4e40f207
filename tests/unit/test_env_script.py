"""``scripts/env.sh`` (what ``demo.sh`` and ``test.sh`` source) run against a stub Python in a
temporary copy of the repository: what it says before the torch download, that pip shows the
download (no ``-q``), that an answer of ``n`` on a terminal really stops before anything is
downloaded, and that a failed torch install leaves no ``.venv`` behind. Nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: A stand-in for python3 without torch: it logs its arguments; ``-m venv DIR`` makes
#: ``DIR/bin/python`` a copy of itself; ``FAIL_TORCH=1`` makes ``pip install torch...`` fail.
STUB = r"""#!/usr/bin/env bash
echo "$*" >> "$STUB_LOG"
case "$1" in
  --version) echo "Python 3.11.0" ;;
  -) cat > /dev/null ;;  # the probe for a torch to reuse: none
  -m)
    if [ "$2" = venv ]; then dir="${@: -1}"; mkdir -p "$dir/bin"; cp "$0" "$dir/bin/python"; fi
    if [ "$2 $3" = "pip install" ] && [ "${FAIL_TORCH:-}" = 1 ] && [[ "$4" == torch* ]]; then exit 1; fi
    ;;
esac
exit 0
"""


@pytest.fixture
def repo(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "env.sh", tmp_path / "scripts" / "env.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    stub = tmp_path / "python3-stub"
    stub.write_text(STUB)
    stub.chmod(0o755)
    return tmp_path


def _run(repo: Path, stdin=subprocess.DEVNULL, **env) -> tuple[subprocess.CompletedProcess, list[str]]:
    log = repo / "stub.log"
    full = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX_URL"}  # only what the test sets
    full.update(PYTHON=str(repo / "python3-stub"), STUB_LOG=str(log), **env)
    out = subprocess.run(["bash", "-c", "source scripts/env.sh"], cwd=repo, stdin=stdin, capture_output=True,
                         text=True, env=full, timeout=60)  # fmt: skip
    return out, (log.read_text().splitlines() if log.exists() else [])


def _torch_installs(log: list[str]) -> list[str]:
    return [line for line in log if line.startswith("-m pip install") and "torch" in line]


def test_the_cuda_download_is_announced_plainly_and_shows_progress(repo):
    out, log = _run(repo)
    assert out.returncode == 0, out.stdout + out.stderr
    text = " ".join(out.stdout.split())
    assert "a .venv of about 5.4 GB" in text and "4.5 GB" not in text
    assert "download.pytorch.org, which a machine that reaches only PyPI cannot use" in text
    assert "install a torch wheel for" in text and "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert "not a terminal, so not asking: downloading the CUDA build" in text
    assert "stop now" not in text  # no instruction to stop that does not stop
    (torch,) = _torch_installs(log)
    assert torch.startswith("-m pip install torch>=") and "-q" not in torch.split(), torch  # pip shows its progress


def test_the_cpu_index_route_shows_progress(repo):
    out, log = _run(repo, TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "installing torch from https://download.pytorch.org/whl/cpu" in out.stdout
    (torch,) = _torch_installs(log)
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch and "-q" not in torch.split(), torch


def test_no_on_a_terminal_stops_before_anything_is_downloaded(repo):
    master, slave = os.openpty()
    try:
        os.write(master, b"n\n")
        out, log = _run(repo, stdin=slave)
    finally:
        os.close(slave)
        os.close(master)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "stopped: nothing was downloaded" in out.stdout
    assert not _torch_installs(log) and not (repo / ".venv").exists(), log


def test_a_failed_torch_install_leaves_no_venv(repo):
    out, log = _run(repo, FAIL_TORCH="1")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "installing torch failed" in out.stderr and not (repo / ".venv").exists()
    assert not any("-e ." in line for line in log)  # sp_kpool (and the CUDA torch with it) not installed after
