#!/usr/bin/env bash
# The docs site into site/ (mkdocs.yml), strict: a broken link or a docstring mkdocstrings cannot read
# fails it. `bash scripts/build_docs.sh serve` serves it on localhost:8000 instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/docs_venv.sh site
export NO_MKDOCS_2_WARNING=1  # mkdocs-material's banner about its successor, printed on every build
if [ "${1:-}" = serve ]; then exec .venv-docs/bin/mkdocs serve; fi
exec .venv-docs/bin/mkdocs build --strict
