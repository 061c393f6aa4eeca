#!/usr/bin/env bash
# Set up .venv (with the dev extra) and run the test suite: lint, then unit, dist and e2e tests.
# Extra arguments go to pytest (e.g. `scripts/test.sh -m "not e2e"`, `scripts/test.sh -m slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
began=$(date +%s)
EXTRAS=dev scripts/setup_env.sh
started=$(date +%s)
# the suite starts hundreds of Python processes (ranks, launchers, commands): write this checkout's bytecode
# once, as a machine that sets PYTHONDONTWRITEBYTECODE (this workplace's do) would have every process compile
# every module of ours again (~0.2 s of CPU each)
.venv/bin/python -m compileall -q open_diloco scripts tests >/dev/null
.venv/bin/ruff format --check open_diloco tests scripts
.venv/bin/ruff check open_diloco tests scripts
# two workers (TEST_WORKERS): most e2e time is waiting on rounds, timeouts and process starts; ports are the
# OS's (tcp/0) and each test ends only the processes it started, so tests may share the machine
.venv/bin/python -m pytest -n "${TEST_WORKERS:-2}" --dist loadgroup "$@"
echo "suite time: $(( $(date +%s) - started )) s (setup $(( started - began )) s before it)"
