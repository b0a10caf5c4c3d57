"""One real server: ``python -m quantd serve`` (uvicorn) on a free loopback port. Jobs accepted survive
a ``kill -9`` of the server; after a restart as API only (``--workers 0``) next to a separate
``quantd worker`` process, with more jobs queued, every accepted job succeeds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from quantd.testing import free_port, quantd_env, spawn, wait_ready

from .conftest import CONFIG, st_bytes

pytestmark = pytest.mark.slow

def _start(command: str, data_dir: Path, log: Path, *args: str,
           extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    env = quantd_env({"QUANTD_LEASE_S": "3", "QUANTD_LOG_LEVEL": "INFO", "QUANTD_DEVICE": "cpu",
                      "QUANTD_WARMUP": "0", **(extra_env or {})})
    return spawn(command, data_dir, log, *args, env=env)


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
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # Quantizing during uploads on: runs in flight when the process dies are lost, their jobs are not.
    procs.append(_start("serve", data_dir, log, "--port", str(port), "--workers", "1",
                        extra_env={"QUANTD_QUANTIZE_DURING_UPLOAD": "on"}))
    wait_ready(base, procs[0], log, timeout_s=60.0)
    with httpx.Client(base_url=base, timeout=30) as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        r = c.get("/v1/info")
        assert r.status_code == 200 and r.headers["x-request-id"]
        first = [_submit(c, seed) for seed in range(6)]
    os.kill(procs[0].pid, signal.SIGKILL)
    procs[0].wait(timeout=30)

    procs.append(_start("serve", data_dir, log, "--port", str(port), "--workers", "0"))
    with httpx.Client(base_url=base, timeout=30) as c:
        # API only: not ready without a worker (the killed one's heartbeat ages out within lease_s).
        deadline, status = time.monotonic() + 60, None
        while time.monotonic() < deadline and status != 503:
            try:
                status = c.get("/readyz").status_code
            except httpx.TransportError:
                status = None
            time.sleep(0.1)  # poll step under a deadline
        assert status == 503
    procs.append(_start("worker", data_dir, log, "--workers", "1"))
    wait_ready(base, procs[1], log, timeout_s=60.0)
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


def test_real_server_warms_the_compiled_kernels_at_start(tmp_path, procs):
    import shutil

    from quantd.engine.kernels import compile_setting

    # The server is a new process: what matters is its environment, not this process's kernel switch.
    if compile_setting() == "off" or shutil.which(os.environ.get("CXX") or "c++") is None:
        pytest.skip("no C++ compiler, or QUANTD_COMPILE=0: the compiled kernels (and their warm-up) are off")
    data_dir, log = tmp_path / "data", tmp_path / "server.log"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    procs.append(_start("serve", data_dir, log, "--port", str(port), "--workers", "1",
                        extra_env={"QUANTD_WARMUP": "1"}))
    wait_ready(base, procs[0], log, timeout_s=60.0)  # serving while the kernels compile in the background
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and "compiled kernels ready" not in log.read_text():
        assert procs[0].poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)  # poll step under a deadline
    text = log.read_text()
    assert "compiled kernels ready" in text and "warm-up failed" not in text, text[-3000:]
    assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
