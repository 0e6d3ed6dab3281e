#!/usr/bin/env bash
# Quick start 1: set up, then run the fused RMSNorm + SwiGLU demo (checks itself; times on a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m coda demo "$@"
