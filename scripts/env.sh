# Sourced by scripts/demo.sh and scripts/test.sh: make a virtual environment (.venv) with
# sp_kpool and the given extra installed, once; later calls reuse it.
#   usage: source scripts/env.sh [extra]
# When the Python that runs this ($PYTHON, default python3) already has a torch at least as
# recent as pyproject.toml asks, .venv sees its packages (--system-site-packages) and pip
# keeps that torch: nothing large is downloaded. Otherwise torch comes from the package
# index (on Linux its default build is the CUDA one: a .venv of about 5.4 GB with its
# nvidia-* wheels), downloaded with pip's progress shown. On a terminal this asks before
# that download (n stops, nothing downloaded); elsewhere it says so and goes on.
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu installs the CPU-only build instead:
# that index is on download.pytorch.org, which a machine that reaches only PyPI cannot use
# (there: install a torch wheel for $PYTHON first, and .venv reuses it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
extra=${1:-}
py=${PYTHON:-python3}
min_torch=$(sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml | head -n 1)
if [ ! -x .venv/bin/python ]; then
  have=$("$py" - "$min_torch" <<'PY' 2>/dev/null || true
import sys
def version(text):
    return tuple(int(p) for p in text.split("+")[0].split(".")[:2])
try:
    import torch
except Exception:
    sys.exit(0)
print(torch.__version__ if version(torch.__version__) >= version(sys.argv[1]) else "old " + torch.__version__)
PY
)
  case "$have" in
    "" | old*)
      echo "[sp_kpool] creating .venv with $($py --version) (${have:+its torch ${have#old } is older than $min_torch; }no torch >= $min_torch to reuse)"
      if [ -n "${TORCH_INDEX_URL:-}" ]; then
        echo "[sp_kpool] installing torch from $TORCH_INDEX_URL (TORCH_INDEX_URL; the CPU-only build is about 1 GB;" \
             "pip shows the download)"
        index=(--index-url "$TORCH_INDEX_URL")
      else
        echo "[sp_kpool] torch comes from the package index (PyPI): on Linux the CUDA build, a .venv of about 5.4 GB" \
             "(torch and its nvidia-* wheels), several minutes of download; pip shows its progress."
        echo "[sp_kpool] the CPU-only torch (about 1 GB) is on another index, download.pytorch.org, which a machine" \
             "that reaches only PyPI cannot use: there, install a torch wheel for $py first and .venv reuses it;" \
             "elsewhere: TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash $0"
        if [ -t 0 ]; then
          read -r -p "[sp_kpool] download the CUDA build from PyPI now? [Y/n] " answer || answer=n
          case "$answer" in
            [nN]*) echo "[sp_kpool] stopped: nothing was downloaded"; return 1 2>/dev/null || exit 1 ;;
          esac
        else
          echo "[sp_kpool] not a terminal, so not asking: downloading the CUDA build"
        fi
        index=()
      fi
      "$py" -m venv .venv
      .venv/bin/python -m pip install -q --upgrade pip
      if ! .venv/bin/python -m pip install "torch>=$min_torch" ${index[@]+"${index[@]}"}; then
        rm -rf .venv  # the next run starts over (a .venv without torch would fetch the CUDA build quietly)
        echo "[sp_kpool] installing torch failed (see pip's message above); .venv removed" >&2
        return 1 2>/dev/null || exit 1
      fi
      ;;
    *)
      echo "[sp_kpool] creating .venv with $($py --version) on top of its packages: reusing its torch $have (>= $min_torch)"
      "$py" -m venv --system-site-packages .venv
      ;;
  esac
fi
stamp=".venv/.installed${extra:+-$extra}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  case "$extra" in
    test) size="the test extra adds about 1.1 GB (triton 0.9 GB, transformers 0.13 GB, Open MPI, pytest, ...)" ;;
    *) size="besides torch only numpy" ;;
  esac
  echo "[sp_kpool] installing sp_kpool${extra:+[$extra]} into .venv: $size"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".${extra:+[$extra]}"
  touch "$stamp"
fi
export PATH="$PWD/.venv/bin:$PATH"
