"""One real server: ``run_server`` under uvicorn on a free loopback port. Jobs accepted survive a
``kill -9`` of the server; after a restart (with more jobs queued) every accepted job succeeds."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import CONFIG, st_bytes

pytestmark = pytest.mark.slow

LAUNCH = "from quantd.server.main import run_server; from quantd.server.settings import Settings; run_server(Settings())"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(data_dir: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "QUANTD_DATA_DIR": str(data_dir), "QUANTD_PORT": str(port), "QUANTD_HOST": "127.0.0.1",
           "QUANTD_WORKERS": "1", "QUANTD_DEVICE": "cpu", "QUANTD_LEASE_S": "3", "QUANTD_LOG_LEVEL": "INFO"}
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-c", LAUNCH], env=env, stdout=out, stderr=subprocess.STDOUT)


def _wait_ready(base: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/readyz", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)  # poll step under a deadline
    raise AssertionError(f"server not ready in {timeout} s:\n{log.read_text()[-3000:]}")


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)


def _submit(client: httpx.Client, seed: int) -> str:
    files = {"file": (f"m{seed}.safetensors", st_bytes(seed=seed), "application/octet-stream")}
    r = client.post("/v1/jobs", files=files, data={"config": json.dumps(CONFIG)})
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def test_real_server_survives_kill_9(tmp_path, procs):
    data_dir, log = tmp_path / "data", tmp_path / "server.log"
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    procs.append(_start(data_dir, port, log))
    _wait_ready(base, procs[0], log)
    with httpx.Client(base_url=base, timeout=30) as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        r = c.get("/v1/info")
        assert r.status_code == 200 and r.headers["x-request-id"]
        first = [_submit(c, seed) for seed in range(6)]
    os.kill(procs[0].pid, signal.SIGKILL)
    procs[0].wait(timeout=30)

    procs.append(_start(data_dir, port, log))
    _wait_ready(base, procs[1], log)
    with httpx.Client(base_url=base, timeout=30) as c:
        more = [_submit(c, seed) for seed in range(6, 9)]
        deadline = time.monotonic() + 120
        pending = set(first + more)
        jobs: dict[str, dict[str, object]] = {}
        while pending and time.monotonic() < deadline:
            for job_id in list(pending):
                job = c.get(f"/v1/jobs/{job_id}").json()
                if job["status"] in ("succeeded", "failed", "cancelled"):
                    jobs[job_id] = job
                    pending.discard(job_id)
            time.sleep(0.2)  # poll step under a deadline
        assert not pending, f"jobs not finished: {pending}\n{log.read_text()[-3000:]}"
        assert {j["status"] for j in jobs.values()} == {"succeeded"}, [j.get("error") for j in jobs.values()]
        artifact = c.get(f"/v1/jobs/{first[0]}/artifact")
        assert artifact.status_code == 200 and artifact.headers["etag"].strip('"') == jobs[first[0]]["result"][
            "artifact_sha256"]
        metrics = c.get("/metrics").text
        assert 'quantd_jobs{status="succeeded"} 9' in metrics
    # one JSON line per request in the server log
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    access = [x for x in lines if x.get("logger") == "quantd.access"]
    assert any(x["path"] == "/v1/info" and x["status"] == 200 and x["request_id"] for x in access)
