#!/usr/bin/env bash
# Create (or reuse) .venv with open_diloco installed. Needs only python3 >= 3.10 and pip access to PyPI.
#   EXTRAS=dev scripts/setup_env.sh     # with the test tools
#   TORCH_VERSION=2.13.0                # the tested torch (the CPU wheel on CPU-only machines)
#   CONSTRAINTS=constraints.txt         # the tested versions of everything else; CONSTRAINTS= resolves freely
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
constraints="${CONSTRAINTS-constraints.txt}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
extras="${EXTRAS:+[$EXTRAS]}"
# Reinstall when the requirements or the tested set change.
stamp=".venv/.installed-$(cat pyproject.toml ${constraints:+"$constraints"} | sha1sum | cut -c1-12)${EXTRAS:+-$EXTRAS}"
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
  .venv/bin/python -m pip install -q -e ".${extras}" ${constraints:+-c "$constraints"}
  touch "$stamp"
fi
# Bytecode for the checkout itself (pip compiled everything it installed, but not an editable package): with
# PYTHONDONTWRITEBYTECODE set, as in many containers, every trainer rank would compile open_diloco anew
# (~0.15 CPU-s each; the suite starts well over a hundred ranks). Cheap when nothing changed.
.venv/bin/python -m compileall -q -j 0 open_diloco scripts tests > /dev/null
