#!/usr/bin/env bash
# Create .venv-docs (once): the lint's and the docs site's tools, apart from .venv so that its pins stay.
# `docs_venv.sh lint` installs ruff only (seconds: CI's lint runs before the tests); `docs_venv.sh site`
# adds the `docs` extra's packages, read from pyproject.toml (mkdocs reads the docstrings from src/
# without importing tpfuse, so neither tpfuse nor torch is installed here).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv-docs/bin/python ] || python3 -m venv .venv-docs
if [ "${1:-lint}" = lint ]; then
  [ -x .venv-docs/bin/ruff ] || .venv-docs/bin/python -m pip install -q ruff
else
  .venv-docs/bin/python -c 'import mkdocstrings, material' 2>/dev/null || \
    .venv-docs/bin/python -m pip install -q $(python3 -c 'import tomllib
print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))')
fi
