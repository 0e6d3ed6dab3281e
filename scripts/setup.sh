#!/usr/bin/env bash
# Create .venv (seeing system packages, so a GPU machine's torch/triton are used as they are)
# and install coda. Without a CUDA torch, install the pinned CPU stack instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv --system-site-packages .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "[setup] CUDA torch found: using the installed torch and triton"
  python -c "import pydantic, pytest, hypothesis" 2>/dev/null || python -m pip install -q "pydantic>=2" pytest hypothesis
else
  echo "[setup] no CUDA torch: installing the pinned CPU stack (requirements-cpu.txt)"
  python -m pip install -q --disable-pip-version-check -r requirements-cpu.txt
fi
python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>/dev/null \
  || python -m pip install -q --disable-pip-version-check --no-deps -e .
python -c "import coda, torch, triton; print(f'[setup] coda {coda.__version__}, torch {torch.__version__}, triton {triton.__version__}')"
