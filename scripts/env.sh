# Sourced by scripts/demo.sh and scripts/test.sh: make a virtual environment (.venv) with
# sp_kpool and the given extra installed, once; later calls reuse it.
#   usage: source scripts/env.sh [extra]
# When the Python that runs this ($PYTHON, default python3) already has a torch at least as
# recent as pyproject.toml asks, .venv sees its packages (--system-site-packages) and pip
# keeps that torch: nothing large is downloaded. Otherwise torch comes from the package
# index (on Linux its default build is the CUDA one, about 5 GB installed with its nvidia-*
# wheels); TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu installs the CPU-only build.
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
      "$py" -m venv .venv
      if [ -n "${TORCH_INDEX_URL:-}" ]; then
        echo "[sp_kpool] installing torch from $TORCH_INDEX_URL (TORCH_INDEX_URL; the CPU-only build is about 1 GB)"
        .venv/bin/python -m pip install -q --upgrade pip
        .venv/bin/python -m pip install -q torch --index-url "$TORCH_INDEX_URL"
      else
        echo "[sp_kpool] torch will come from the package index: on Linux the CUDA build, about 4.5 GB installed" \
             "(torch 1.2 GB + nvidia-* wheels 3.2 GB); for a CPU-only torch (about 1 GB) stop now and rerun with" \
             "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu, or install torch for $py first"
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
