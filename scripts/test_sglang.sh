#!/usr/bin/env bash
# tpfuse's SGLang plugin against SGLang's own modules on 2 CPU ranks (tests/engines/test_sglang.py), in
# .venv-sglang (made by setup_venv.sh sglang on first use: SGLang pins torch 2.14.1, which .venv does not take).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh sglang
TRITON_INTERPRET=1 exec .venv-sglang/bin/python -m pytest tests/engines/test_sglang.py -q -p no:cacheprovider "$@"
