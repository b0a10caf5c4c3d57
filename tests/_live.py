"""One way to run a real ``python -m quantd serve`` on a free loopback port for tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _inductor_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


@contextmanager
def live_server(root: Path, *, api_keys: str | None = None, port_from_env: bool = False,
                timeout_s: float = 90.0) -> Iterator[str]:
    """Start the server with data under ``root``, wait for /readyz (deadline), yield its URL, stop it.

    ``port_from_env`` passes the port as ``QUANTD_PORT`` instead of ``--port`` (serve's flags default
    from ``QUANTD_*``)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTD_")}
    env["QUANTD_WARMUP"] = "0"  # no background compiling competing with the tests (test_uvicorn checks it)
    # The compiled kernels' cache shared with the test process (serve's default is one in its data dir,
    # which would compile every kernel afresh in each live server).
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", _inductor_cache_dir())
    if api_keys:
        env["QUANTD_API_KEYS"] = api_keys
    cmd = [sys.executable, "-m", "quantd", "serve", "--data-dir", str(root / "data"), "--workers", "1",
           "--device", "cpu"]
    if port_from_env:
        env["QUANTD_PORT"] = str(port)
    else:
        cmd += ["--port", str(port)]
    log = root / "server.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
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
