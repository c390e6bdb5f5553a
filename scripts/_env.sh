# Sourced by the scripts: create/reuse .venv and install the project into it.
# torch==2.13.0 is installed first when no torch is present: it is the CPU build that lies on
# local disk; an unpinned torch (also pulled in by deepspeed) would download a multi-GB CUDA build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[adacheck] creating .venv"
  "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  echo "[adacheck] installing torch==2.13.0 (CPU)"
  "$VPY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi
EXTRA="${1:-}"
STAMP=".venv/.adacheck-installed${EXTRA:+-$EXTRA}"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ constraints.txt -nt "$STAMP" ]; then
  echo "[adacheck] installing adacheck${EXTRA:+[$EXTRA]} into .venv"
  "$VPY" -m pip install -q --disable-pip-version-check -c constraints.txt -e ".${EXTRA:+[$EXTRA]}"
  touch "$STAMP"
fi
export DS_ACCELERATOR=cpu
