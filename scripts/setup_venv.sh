#!/usr/bin/env bash
# Create .venv (once) with torch, triton and tpfuse installed editable. Used by demo.sh and test.sh.
# `setup_venv.sh newest-transformers` also installs the newest transformers release (5.24.0), as an
# overlay of .venv (.venv/transformers-newest: put it first on PYTHONPATH to use it), e.g.
#   PYTHONPATH=$PWD/.venv/transformers-newest bash scripts/test.sh -k "test_clients and Llama"
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import tpfuse, torch, triton, pytest, transformers, accelerate" 2>/dev/null; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0" "triton==3.6.0" "pytest>=8" numpy "transformers==5.17.0" "accelerate==1.15.0"
  .venv/bin/python -m pip install -q --no-deps -e .
fi
NEWEST_TRANSFORMERS=5.24.0
if [ "${1:-}" = newest-transformers ] && ! PYTHONPATH=.venv/transformers-newest .venv/bin/python -c \
    "import sys, transformers; sys.exit(transformers.__version__ != '$NEWEST_TRANSFORMERS')" 2>/dev/null; then
  rm -rf .venv/transformers-newest
  .venv/bin/python -m pip install -q --no-deps --target .venv/transformers-newest "transformers==$NEWEST_TRANSFORMERS"
fi
