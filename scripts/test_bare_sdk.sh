#!/usr/bin/env bash
# Proves the bare `pip install` gives a working SDK with neither torch nor fastapi installed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/venv
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q . pytest
"$venv/bin/python" - <<'PY'
import importlib.util, sys
for banned in ("torch", "fastapi", "uvicorn", "starlette"):
    assert importlib.util.find_spec(banned) is None, f"{banned} is installed in the bare venv"
PY
QUANTD_BARE=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/client_bare
rm -rf "$(dirname "$venv")"
