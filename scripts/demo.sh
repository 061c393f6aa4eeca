#!/usr/bin/env bash
# The main demo: set up .venv if needed, then run a local galaxy (DHT + 2 clusters x 2 ranks, fake data).
# Arguments go to scripts/run_galaxy.sh (see its --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
exec scripts/run_galaxy.sh "$@"
