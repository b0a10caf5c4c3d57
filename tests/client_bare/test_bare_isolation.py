"""The SDK and the CLI's client commands need no torch and no fastapi."""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys

import pytest

from quantd_client._progress import ProgressBar, Reporter

HEAVY = ("torch", "fastapi", "uvicorn", "safetensors", "starlette")


def test_importing_sdk_and_cli_pulls_in_nothing_heavy() -> None:
    code = ("import sys, quantd_client._client, quantd_client._async, quantd_client._job, "
            "quantd_client._results, quantd.cli; "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""


@pytest.mark.skipif(os.environ.get("QUANTD_BARE") != "1", reason="only in the bare-install venv (QUANTD_BARE=1)")
def test_bare_venv_really_has_no_torch_or_fastapi() -> None:
    assert [m for m in ("torch", "fastapi", "pytest_asyncio", "hypothesis") if importlib.util.find_spec(m)] == []


def test_progress_bar_draws_and_finishes() -> None:
    out = io.StringIO()
    bar = ProgressBar("upload m.bin", 2048, stream=out)
    bar.set(1024)
    bar.set(2048)
    bar.close()
    text = out.getvalue()
    assert "50%" in text and "100%" in text and text.endswith("\n")
    assert "2.0 KiB / 2.0 KiB" in text


def test_reporter_off_and_auto_on_non_tty() -> None:
    out = io.StringIO()  # not a TTY: auto means no bar
    r = Reporter(None, "x", 10, stream=out)
    r.set(5)
    r.close()
    assert not r.enabled and out.getvalue() == ""
    r = Reporter(True, "x", 10, stream=out)
    r.set(10)
    r.close()
    assert r.enabled and "100%" in out.getvalue()
