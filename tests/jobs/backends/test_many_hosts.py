"""Processes that stand for hosts: two API replicas (``quantd serve --workers 0``) and two worker processes
on one PostgreSQL and one bucket, each with its own scratch directory. 50 jobs submitted at once through
both replicas all succeed, each run once; a worker killed with SIGKILL mid-job and a replica killed
mid-upload lose no accepted job, run none twice, and leave nothing in the bucket but the live jobs' files."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save
from servers import free_port

from quantd.jobs import LocalStorage
from quantd.jobs.backends.postgres import PostgresJobStore
from quantd.jobs.backends.s3 import S3Storage
from quantd.jobs.pool import TMP_MAX_AGE_S

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
CONFIG = json.dumps({"scheme": {"dtype": "int4", "group_size": 32}})
LEASE_S = 3.0


def model(seed: int, tensors: int = 2) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return save({f"layer.{i}.weight": torch.randn(32, 64, generator=g) for i in range(tensors)})


def wait_for(pred: Any, *, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := pred()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
    return value


@dataclass
class Cluster:
    root: Path
    env: dict[str, str]
    db_url: str
    storage: S3Storage
    runs_log: Path
    apis: list[tuple[subprocess.Popen[bytes], str]] = field(default_factory=list)
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Any] = field(default_factory=list)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self.logs.append(log)
        env = {**self.env, "QUANTD_DATA_DIR": str(self.root / name)}
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    def start_api(self, name: str, port: int | None = None) -> str:
        port = port or free_port()
        proc = self._spawn(name, [sys.executable, "-m", "quantd", "serve", "--host", "127.0.0.1", "--port",
                                  str(port), "--workers", "0"])
        self.apis.append((proc, f"http://127.0.0.1:{port}"))
        return f"http://127.0.0.1:{port}"

    def start_worker(self, name: str) -> subprocess.Popen[bytes]:
        proc = self._spawn(name, [sys.executable, str(HERE / "scale_worker.py"), str(self.runs_log)])
        self.workers.append(proc)
        return proc

    def wait_ready(self, url: str) -> None:
        def ready() -> bool:
            try:
                return httpx.get(url + "/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=120, what=f"{url} to be ready")

    def runs(self) -> Counter[str]:
        return Counter(self.runs_log.read_text().split()) if self.runs_log.exists() else Counter()

    def stop(self) -> None:
        for proc in [p for p, _ in self.apis] + self.workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [p for p, _ in self.apis] + self.workers:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()


@pytest.fixture(scope="module")
def cluster(pg_server: Any, s3: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("hosts")
    db_url = pg_server.create_database(f"hosts_{uuid.uuid4().hex[:8]}")
    bucket = f"hosts-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(bucket)
    env = {**os.environ, "QUANTD_DATABASE_URL": db_url, "QUANTD_STORAGE_URL": f"s3://{bucket}/q",
           "QUANTD_S3_ENDPOINT_URL": s3.endpoint, "QUANTD_LEASE_S": str(LEASE_S), "QUANTD_WARMUP": "0",
           "QUANTD_LOG_LEVEL": "WARNING", "QUANTD_DEVICE": "cpu", "QUANTD_TEST_TENSOR_DELAY_S": "0.5",
           "QUANTD_QUANTIZE_DURING_UPLOAD": "off"}
    c = Cluster(root, env, db_url, S3Storage(f"s3://{bucket}/q", root / "probe", client=s3.client()),
                root / "runs.log")
    try:
        urls = [c.start_api("api0"), c.start_api("api1")]
        c.start_worker("worker0")
        c.start_worker("worker1")
        for url in urls:
            c.wait_ready(url)
        yield c
    finally:
        c.stop()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=60) as client:
        yield client


async def submit(http: httpx.AsyncClient, url: str, data: bytes, filename: str) -> dict[str, Any]:
    r = await http.post(url + "/v1/jobs", files={"file": (filename, data)}, data={"config": CONFIG})
    assert r.status_code == 202, r.text
    return dict(r.json())


def final_states(c: Cluster, ids: list[str], timeout: float) -> dict[str, Any]:
    store = PostgresJobStore(c.db_url, migrate=False)
    try:
        recs = wait_for(lambda: (rs := [store.get(i) for i in ids]) and all(r is not None and r.terminal for r in rs)
                        and rs, timeout=timeout, what="every job to finish")
    finally:
        store.close()
    return {r.id: r for r in recs}


def assert_bucket_holds_only(c: Cluster, ids: list[str]) -> None:
    live = {f"q/{folder}/{i}{suffix}" for i in ids for folder, suffix in
            (("uploads", ".input"), ("artifacts", ".safetensors"), ("reports", ".json"))}
    assert set(c.storage.list_keys()) == live
    # A replica killed while streaming an upload leaves an unfinished multipart upload (parts, not an object).
    # The reapers' sweep aborts those older than TMP_MAX_AGE_S when it next lists the bucket (every
    # LIST_INTERVAL_S); moto's server dates every multipart upload in 2010, so one sweep here is that pass.
    sweeper = S3Storage(c.storage.location.url, c.root / "sweeper", client=c.storage.client)
    sweeper.init()
    sweeper.sweep_tmp(TMP_MAX_AGE_S)
    assert c.storage.client.list_multipart_uploads(Bucket=c.storage.bucket).get("Uploads", []) == []


async def test_fifty_jobs_at_once_through_both_replicas(cluster: Cluster, http: httpx.AsyncClient) -> None:
    urls = itertools.cycle([url for _, url in cluster.apis])
    jobs = await asyncio.gather(*(submit(http, next(urls), model(seed), f"m{seed}.safetensors")
                                  for seed in range(50)))
    ids = [j["id"] for j in jobs]
    assert len(set(ids)) == 50
    recs = await asyncio.to_thread(final_states, cluster, ids, 240)
    assert {r.status for r in recs.values()} == {"succeeded"}
    assert all(r.attempts == 1 for r in recs.values())
    runs = cluster.runs()
    assert all(runs[i] == 1 for i in ids)  # none ran twice
    assert {r.device for r in recs.values()} == {"cpu"}
    # Either replica serves any job's artifact.
    for i, (_, url) in zip(ids[:2], cluster.apis, strict=True):
        r = await http.get(f"{url}/v1/jobs/{i}/artifact", headers={"Range": "bytes=0-7"})
        assert r.status_code == 206 and len(r.content) == 8


async def test_sigkill_of_a_worker_mid_job_and_a_replica_mid_upload(cluster: Cluster,
                                                                     http: httpx.AsyncClient) -> None:
    (_, url0), (api1, url1) = cluster.apis[:2]
    before = [j["id"] for j in (await http.get(url0 + "/v1/jobs?limit=100")).json()["items"]]
    ids = [(await submit(http, url0, model(100 + i, tensors=6), f"slow{i}.safetensors"))["id"] for i in range(4)]
    store = PostgresJobStore(cluster.db_url, migrate=False)
    victim = cluster.workers[0]
    try:
        running = await asyncio.to_thread(wait_for, lambda: [
            r for r in map(store.get, ids) if r is not None and r.status == "running"
            and f"/{victim.pid}/" in (r.lease_owner or "") and r.progress.get("tensors_done", 0) >= 1],
            timeout=120, what="the first worker to be mid-job")
    finally:
        store.close()
    killed_job = running[0].id
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(30)

    # A replica killed while a client streams a model to it: that job was never accepted.
    chunk = os.urandom(1 << 20)
    sent = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield (b'--b\r\nContent-Disposition: form-data; name="config"\r\n\r\n' + CONFIG.encode() +
               b'\r\n--b\r\nContent-Disposition: form-data; name="file"; filename="big.safetensors"\r\n\r\n')
        for n in range(200):
            yield chunk
            if n == 8:
                sent.set()
            await asyncio.sleep(0.02)

    upload = asyncio.create_task(http.post(url1 + "/v1/jobs", content=body(),
                                           headers={"Content-Type": "multipart/form-data; boundary=b"}))
    await asyncio.wait_for(sent.wait(), 60)
    os.kill(api1.pid, signal.SIGKILL)
    api1.wait(30)
    with pytest.raises(httpx.HTTPError):
        await upload
    left = list((cluster.root / "api1" / "tmp").glob("p-*/upload-*"))
    assert left, "the upload was mid-way on the replica's scratch"
    LocalStorage(cluster.root / "api1").init()  # what the replica does when it starts again on its data dir
    assert not any(p.exists() for p in left)

    recs = await asyncio.to_thread(final_states, cluster, ids, 240)
    assert {i: r.status for i, r in recs.items()} == dict.fromkeys(ids, "succeeded")
    assert {i: r.attempts for i, r in recs.items()} == {i: 2 if i == killed_job else 1 for i in ids}
    runs = cluster.runs()
    assert all(runs[i] == 1 for i in ids)  # the killed attempt never finished; none ran to the end twice
    assert_bucket_holds_only(cluster, before + ids)
