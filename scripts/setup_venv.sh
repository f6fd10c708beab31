#!/usr/bin/env bash
# Create .venv (once) with torch, triton and tpfuse installed editable. Used by demo.sh and test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import tpfuse, torch, triton, pytest, transformers, accelerate" 2>/dev/null; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0" "triton==3.6.0" "pytest>=8" numpy "transformers==5.17.0" "accelerate==1.15.0"
  .venv/bin/python -m pip install -q --no-deps -e .
fi
