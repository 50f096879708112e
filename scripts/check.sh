#!/usr/bin/env bash
# The project's checks, as CI runs them: lint, import contracts, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${VIRTUAL_ENV:-.venv}/bin"
"$BIN/ruff" check .
"$BIN/lint-imports"
"$BIN/python" -m pytest "$@"
