#!/usr/bin/env bash
# Set up .venv (with the dev extra) and run the test suite: lint, then unit, dist and e2e tests.
# Extra arguments go to pytest (e.g. `scripts/test.sh -m "not e2e"`, `scripts/test.sh -m slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=dev scripts/setup_env.sh
started=$(date +%s)
.venv/bin/ruff format --check open_diloco tests scripts
.venv/bin/ruff check open_diloco tests scripts
.venv/bin/python -m pytest "$@"
echo "suite time: $(( $(date +%s) - started )) s"
