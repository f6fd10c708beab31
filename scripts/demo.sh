#!/usr/bin/env bash
# The main job: set up (first time only), then run the demo on 2 CPU ranks or on every GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/python -m tpfuse demo "$@"
