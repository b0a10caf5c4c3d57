"""A PostgreSQL restart or an outage: pooled connections that died are replaced before use, a request the
database cannot serve is a 503 with Retry-After (never a 500), and a worker keeps its job's work through it."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest

from quantd.jobs.backends import postgres as pg
from quantd.jobs.backends.postgres import PostgresJobStore
from quantd.jobs.errors import DatabaseUnavailable


def _drop_connections(url: str) -> int:
    """Terminate every other connection to the test's database, as a server restart does to a pool."""
    with psycopg.connect(url, autocommit=True) as admin:
        rows = admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                             " WHERE datname = current_database() AND pid <> pg_backend_pid()").fetchall()
    return len(rows)


def _add(store: PostgresJobStore) -> str:
    job_id = uuid.uuid4().hex
    store.insert(job_id=job_id, tenant="t", config={}, input={"filename": "m", "bytes": 5, "sha256": "0" * 64,
                 "format": "safetensors", "tensors": 1}, calibration=None, idempotency_key=None, max_attempts=3,
                 max_queue=100, retry_after=1, before_commit=lambda: None)
    return job_id


@pytest.fixture
def store(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[PostgresJobStore]:
    monkeypatch.setattr(pg, "_CHECK_IDLE_S", 0.0)  # every pooled connection is checked when lent
    s = PostgresJobStore(pg_url)
    s.init()
    yield s
    s.close()


def test_connections_dropped_by_the_server_are_replaced_before_use(store: PostgresJobStore, pg_url: str) -> None:
    job_id = _add(store)
    barrier = threading.Barrier(3)

    def hold() -> None:  # three connections in the pool at once
        with store._conn():
            barrier.wait(timeout=10)

    threads = [threading.Thread(target=hold) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _drop_connections(pg_url) >= 3
    # before: the first call on each dead pooled connection raised AdminShutdown (a 500, or a failed job)
    for _ in range(4):
        assert store.get(job_id) is not None
    assert store.ping() and store.queue_depth() == 1
    claimed = store.claim("w", "cpu", 30.0)
    assert claimed is not None and claimed.id == job_id


def test_a_database_that_cannot_be_reached_is_database_unavailable(pg_url: str) -> None:
    from servers import free_port

    dead = PostgresJobStore(f"postgresql://quantd@127.0.0.1:{free_port()}/none", connect_timeout_s=1)
    with pytest.raises(DatabaseUnavailable):
        dead.get("x")
    assert dead.ping() is False


async def test_requests_during_an_outage_are_503_and_recover(replicas: Any, pg_url: str, pg_server: Any) -> None:
    from quantd.server.problems import status_of

    assert status_of(DatabaseUnavailable()) == 503
    name = psycopg.conninfo.conninfo_to_dict(pg_url)["dbname"]
    async with replicas({}) as (api,):
        assert (await api.get("/v1/jobs")).status_code == 200
        with psycopg.connect(pg_server.url(), autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            try:
                admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
                r = await api.get("/v1/jobs")
                assert r.status_code == 503, r.text
                assert r.headers["content-type"] == "application/problem+json" and r.headers["retry-after"] == "5"
                assert r.json()["type"] == "urn:quantd:database-unavailable"
                ready = await api.get("/readyz")
                assert ready.status_code == 503 and ready.json()["checks"]["database"] is False
            finally:
                admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        assert (await api.get("/v1/jobs")).status_code == 200


class _FlakyStore:
    """A store whose calls fail with DatabaseUnavailable ``failures`` times, then answer."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0

    def _maybe_fail(self) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise DatabaseUnavailable()

    def heartbeat(self, *args: Any, **kwargs: Any) -> str:
        self._maybe_fail()
        return "ok"

    def lease_state(self, *args: Any) -> str:
        self._maybe_fail()
        return "ok"

    def complete(self, *args: Any, **kwargs: Any) -> bool:
        self._maybe_fail()
        return True


def _job() -> Any:
    return SimpleNamespace(id="j", lease_owner="w#1")  # what a lease reads of its job


def test_a_progress_write_or_lease_check_that_fails_does_not_stop_the_job() -> None:
    from quantd.jobs.worker import _Lease
    from quantd_client import Progress

    store = _FlakyStore(failures=2)
    lease = _Lease(store, _job(), lease_s=30.0, heartbeat_s=10.0, progress_write_s=0.0,
                   shutdown=threading.Event(), on_beat=lambda: None)
    lease.on_progress(Progress(tensors_done=1, tensors_total=2))  # raised into the pipeline: the job crashed
    assert not lease.should_cancel()
    assert not lease.should_cancel() and store.calls == 3 and lease.state == "ok"


def test_recording_the_result_waits_out_a_short_outage(monkeypatch: pytest.MonkeyPatch) -> None:
    from quantd.jobs import worker as worker_mod

    monkeypatch.setattr(worker_mod.time, "sleep", lambda s: None)
    w = worker_mod.Worker.__new__(worker_mod.Worker)
    w.id, w.lease_s, w.stop = "w", 30.0, threading.Event()
    store = _FlakyStore(failures=3)
    assert w._record(store.complete, "j", "w#1", {}) is True and store.calls == 4
    w.lease_s = 0.1  # longer than the lease: the error goes up, the lease expires and the job is retried
    with pytest.raises(DatabaseUnavailable):
        w._record(_FlakyStore(failures=100).complete, "j", "w#1", {})


def test_a_complete_whose_commit_failed_after_the_install_is_recorded_without_moving_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Installing moves the files: tried again as it was, it would find them gone and fail a job that
    succeeded. The worker's install runs once; complete() is tried again and records the job."""
    from quantd.jobs import worker as worker_mod

    monkeypatch.setattr(worker_mod.time, "sleep", lambda s: None)
    w = worker_mod.Worker.__new__(worker_mod.Worker)
    w.id, w.lease_s, w.stop = "w", 30.0, threading.Event()
    moves: list[int] = []
    tries: list[int] = []

    def complete(*args: Any, before_commit: Any) -> bool:
        tries.append(1)
        before_commit()
        if len(tries) == 1:
            raise DatabaseUnavailable()  # the connection dropped after the files moved, before COMMIT
        return True

    install = worker_mod._once(lambda: moves.append(1))
    assert w._record(complete, "j", "w#1", {}, before_commit=install) is True
    assert moves == [1] and len(tries) == 2
