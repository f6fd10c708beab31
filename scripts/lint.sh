#!/usr/bin/env bash
# The lint: ruff with pyproject.toml's rules (pycodestyle errors with lines up to 110, pyflakes, import
# order), from .venv-docs (made on first use). Arguments go to `ruff check` (e.g. --fix, a path).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/docs_venv.sh lint
exec .venv-docs/bin/ruff check "${@:-.}"
