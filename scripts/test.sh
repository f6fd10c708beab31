#!/usr/bin/env bash
# The tests: set up (first time only), then pytest. On a machine without GPUs the kernels run in
# Triton's CPU interpreter; ranks are processes joined by gloo (and NCCL where there are 2+ GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
if ! .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export TRITON_INTERPRET=1
  # Inductor compiles in each rank process itself, without a pool of compile workers: on a 2-core
  # machine the pools only contend with the ranks (HF Llama's test: 55 -> 44 s).
  export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
fi
# No path named: pytest takes pyproject.toml's testpaths (tests/); a path named runs that path alone.
exec .venv/bin/python -m pytest -q "$@"
