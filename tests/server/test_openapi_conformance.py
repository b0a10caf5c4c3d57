"""The OpenAPI document is true: schemathesis generates requests from ``/openapi.json`` and checks a live
server's answers against it (status codes, content types, headers, bodies, ``Allow`` on OPTIONS, auth as
declared), with the server open and with API keys. Bounded: a fixed seed and a few examples per operation.

Two checks are left out. ``positive_data_acceptance`` expects every schema-valid request to succeed, and
what a weights file must contain (a safetensors header, a checkpoint) or which list cursors exist is not
something JSON Schema can say, so such requests get their 4xx. ``use_after_free`` expects a resource to
be gone after a successful DELETE, while ``DELETE /v1/jobs/{id}`` cancels the job and deletes its files
and the job itself stays readable, with status ``cancelled``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from _live import LIVE_API_KEY

pytest.importorskip("schemathesis", reason="schemathesis (the dev extra) runs these checks")

MAX_EXAMPLES = 10


def run_schemathesis(base: str, report: Path, *, api_key: str | None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{base}/openapi.json",
           "--checks", "all", "--exclude-checks", "positive_data_acceptance,use_after_free",
           "--max-examples", str(MAX_EXAMPLES), "--seed", "20261125", "--generation-database", "none",
           "--workers", "1", "--request-timeout", "30", "--no-color", "--report", "json",
           "--report-json-path", str(report)]
    if api_key:
        cmd += ["--header", f"Authorization: Bearer {api_key}"]
    # In the report's folder: schemathesis keeps a cache of its own under the working directory.
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=report.parent)
    assert report.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(report.read_text())
    result["output"] = done.stdout[-6000:]
    result["returncode"] = done.returncode
    return result


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["open", "keyed"])
def test_the_api_conforms_to_its_openapi_document(mode: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """On the test run's shared live servers (tests/conftest.py): a temp data dir each."""
    key = LIVE_API_KEY if mode == "keyed" else None
    base = request.getfixturevalue("live_keyed_url" if key else "live_open_url")
    result = run_schemathesis(base, tmp_path / "report.json", api_key=key)
    assert result["failures"] == [] and result["errors"] == [], result["output"]
    assert result["returncode"] == 0 and result["complete"], result["output"]
    assert result["operations"]["tested"] == result["operations"]["total"] >= 15
    assert result["test_cases"]["generated"] > 20 * result["operations"]["total"]  # it really ran
    assert all(p["status"] == "success" for p in result["phases"].values()), result["phases"]
    assert result["warnings"]["missing_auth"] == []
