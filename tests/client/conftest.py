"""A live quantd server for the SDK's happy paths: ``python -m quantd serve`` on a free loopback port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

API_KEY = "sdk-test-key-0001"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(data_dir: Path, *, api_keys: str | None) -> tuple[subprocess.Popen[bytes], str, Path]:
    port = free_port()
    log = data_dir.parent / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTD_")}
    if api_keys:
        env["QUANTD_API_KEYS"] = api_keys
    cmd = [sys.executable, "-m", "quantd", "serve", "--port", str(port), "--data-dir", str(data_dir),
           "--workers", "1", "--device", "cpu"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/readyz", timeout=1.0).status_code == 200:
                return proc, base, log
        except httpx.TransportError:
            pass
        time.sleep(0.1)  # poll step under a deadline
    proc.kill()
    raise AssertionError(f"server not ready in 90 s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def api_key() -> str:
    return API_KEY


@pytest.fixture(scope="session")
def live_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("sdk-live")
    proc, base, _ = start_server(root / "data", api_keys=f"sdk:{API_KEY}")
    try:
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
