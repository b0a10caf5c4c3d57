"""Run a real ``python -m quantd serve`` (or ``worker``) process for integration tests and benchmarks:
a free loopback port, a data directory of its own, a deadline on readiness, and a clean stop.

Needs only the standard library and httpx (no torch, no server imports), so outside-in tests that must
not import quantd's internals can use it too::

    with live_server(tmp_path) as srv:
        httpx.get(f"{srv.url}/v1/info")
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def quantd_env(extra: Mapping[str, str] | None = None, *, inherit_quantd: bool = False) -> dict[str, str]:
    """This process's environment for a child quantd: without its ``QUANTD_*`` settings unless
    ``inherit_quantd``, then ``extra`` on top."""
    env = {k: v for k, v in os.environ.items() if inherit_quantd or not k.startswith("QUANTD_")}
    env.update(extra or {})
    return env


def spawn(command: str, data_dir: Path, log: Path, *args: str, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """``python -m quantd COMMAND --data-dir DATA_DIR ARGS...`` with stdout and stderr appended to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "quantd", command, "--data-dir", str(data_dir), *args],
                                env=dict(env), stdout=out, stderr=subprocess.STDOUT)


def log_tail(log: Path, chars: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, *, path: str = "/readyz",
               timeout_s: float = 90.0) -> None:
    """Poll ``url + path`` until it answers 200; AssertionError with the log's tail if the process exits or
    the deadline passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"quantd exited with {proc.returncode}:\n{log_tail(log)}")
        try:
            if httpx.get(f"{url}{path}", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} not 200 within {timeout_s:.0f} s:\n{log_tail(log)}")
        time.sleep(0.1)  # poll step under a deadline


def stop(proc: subprocess.Popen[bytes], *, timeout_s: float = 30.0) -> None:
    """SIGTERM (a graceful shutdown), then SIGKILL if it has not exited within ``timeout_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)


@dataclass
class LiveServer:
    url: str
    process: subprocess.Popen[bytes]
    data_dir: Path
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        return log_tail(self.log_path, chars)


@contextmanager
def live_server(root: Path, *, env: Mapping[str, str] | None = None, inherit_quantd_env: bool = False,
                workers: int = 1, device: str = "cpu", args: Sequence[str] = (), port_from_env: bool = False,
                ready_path: str = "/readyz", timeout_s: float = 90.0) -> Iterator[LiveServer]:
    """``quantd serve`` with its data under ``root/data`` and its log at ``root/server.log``, on a free
    loopback port; yields once ``ready_path`` answers 200 and stops the process on exit.

    ``env`` is added to this process's environment (whose ``QUANTD_*`` settings are dropped unless
    ``inherit_quantd_env``); ``port_from_env`` passes the port as ``QUANTD_PORT`` instead of ``--port``."""
    port = free_port()
    child_env = quantd_env(env, inherit_quantd=inherit_quantd_env)
    cmd = ["--host", "127.0.0.1", "--workers", str(workers), "--device", device, *args]
    if port_from_env:
        child_env["QUANTD_PORT"] = str(port)
    else:
        cmd += ["--port", str(port)]
    root.mkdir(parents=True, exist_ok=True)
    server = LiveServer(f"http://127.0.0.1:{port}", spawn("serve", root / "data", root / "server.log", *cmd,
                                                          env=child_env), root / "data", root / "server.log")
    try:
        wait_ready(server.url, server.process, server.log_path, path=ready_path, timeout_s=timeout_s)
        yield server
    finally:
        stop(server.process)
