#!/usr/bin/env bash
# Quick start 2: set up, then run the test suite (interpreter on CPU; larger shapes on a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
workers=$(python -c "import os; print(min(4, os.cpu_count() or 1))")
if python -c "import xdist" 2>/dev/null && [ "$workers" -gt 1 ]; then
  exec python -m pytest -q -n "$workers" "$@"
fi
exec python -m pytest -q "$@"
