"""A live server for the CLI's ``--server`` paths: ``python -m quantd serve`` on a free loopback port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest


@pytest.fixture(scope="session")
def cli_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("cli-live")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTD_")}
    env["QUANTD_PORT"] = str(port)  # from the environment: serve's flags default from QUANTD_*
    log = root / "server.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "quantd", "serve", "--data-dir", str(root / "data"),
                                 "--workers", "1", "--device", "cpu"], env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"server not ready (rc {proc.poll()}):\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{base}/readyz", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)  # poll step under a deadline
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
