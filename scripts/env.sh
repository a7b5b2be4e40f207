# Sourced by scripts/demo.sh and scripts/test.sh: make a virtual environment (.venv) with
# sp_kpool and the given extra installed, once; later calls reuse it.
#   usage: source scripts/env.sh [extra]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
extra=${1:-}
py=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[sp_kpool] creating .venv with $($py --version)"
  "$py" -m venv .venv
fi
stamp=".venv/.installed${extra:+-$extra}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[sp_kpool] installing sp_kpool${extra:+[$extra]} into .venv (first run takes a few minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".${extra:+[$extra]}"
  touch "$stamp"
fi
export PATH="$PWD/.venv/bin:$PATH"
