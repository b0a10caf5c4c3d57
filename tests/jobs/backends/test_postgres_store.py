"""The PostgreSQL job store against a real server: atomic claim across connections, leases on the database's
clock, fencing, reaping, idempotency and tenants, notifications, versioned migrations."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import psycopg
import pytest

from quantd.jobs import QueueFull
from quantd.jobs.backends.postgres import CHANNEL, LATEST, PostgresJobStore, schema_version, upgrade
from quantd.jobs.errors import StorageError


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def add(store: PostgresJobStore, *, tenant: str = "t", key: str | None = None, max_attempts: int = 3,
        max_queue: int = 10_000, before_commit: Any = lambda: None) -> tuple[Any, bool]:
    return store.insert(job_id=uuid.uuid4().hex, tenant=tenant, config={}, input={"filename": "m", "bytes": 5,
                        "sha256": "0" * 64, "format": "safetensors", "tensors": 1}, calibration=None,
                        idempotency_key=key, max_attempts=max_attempts, max_queue=max_queue, retry_after=7,
                        before_commit=before_commit)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(pg_url: str, clock: Clock) -> Any:
    s = PostgresJobStore(pg_url, clock=clock)
    s.init()
    yield s
    s.close()


def test_migrations_are_versioned_and_applied_once(pg_url: str) -> None:
    assert schema_version(pg_url) == 0
    results: list[list[int]] = []
    threads = [threading.Thread(target=lambda: results.append(upgrade(pg_url))) for _ in range(3)]
    for t in threads:  # processes starting together take turns under the advisory lock
        t.start()
    for t in threads:
        t.join()
    assert sorted(map(len, results)) == [0, 0, LATEST]
    assert schema_version(pg_url) == LATEST
    assert upgrade(pg_url) == []


def test_a_store_that_may_not_migrate_refuses_an_old_schema(pg_url: str) -> None:
    with pytest.raises(StorageError, match="quantd db upgrade"):
        PostgresJobStore(pg_url, migrate=False).init()
    upgrade(pg_url)
    PostgresJobStore(pg_url, migrate=False).init()


def test_a_schema_newer_than_this_release_is_refused(pg_url: str) -> None:
    """A rollback onto a database a newer release migrated: refused, not 'up to date'."""
    upgrade(pg_url)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("INSERT INTO quantd_schema (version, description) VALUES (%s, 'from the future')", (LATEST + 1,))
    for migrate in (True, False):
        with pytest.raises(StorageError, match=f"version {LATEST + 1}, newer than this quantd's"):
            PostgresJobStore(pg_url, migrate=migrate).init()
    with pytest.raises(StorageError, match="newer"):
        upgrade(pg_url)


def test_claim_is_atomic_across_connections(pg_url: str) -> None:
    """Four stores (as four hosts would have), two threads each, drain 80 jobs: each claimed exactly once."""
    stores = [PostgresJobStore(pg_url) for _ in range(4)]
    stores[0].init()
    ids = {add(stores[0])[0].id for _ in range(80)}
    claimed: list[str] = []
    lock = threading.Lock()

    def drain(i: int) -> None:
        while (job := stores[i % 4].claim(f"w{i}", "cpu", 30.0)) is not None:
            assert job.attempts == 1 and job.status == "running"
            with lock:
                claimed.append(job.id)

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claimed) == sorted(ids)
    for s in stores:
        s.close()


def test_claim_takes_the_oldest_and_counts_the_attempt(store: PostgresJobStore, clock: Clock) -> None:
    first = add(store)[0]
    clock.t += 1
    add(store)
    job = store.claim("w", "cuda:1", 30.0)
    assert job is not None and job.id == first.id
    assert (job.attempts, job.device, job.lease_owner) == (1, "cuda:1", "w#1")
    assert job.lease_expires_at == pytest.approx(clock.t + 30.0)


def test_expired_lease_requeued_then_failed_after_max_attempts(store: PostgresJobStore, clock: Clock) -> None:
    job_id = add(store, max_attempts=2)[0].id
    store.claim("w", "cpu", 10.0)
    assert store.reap(lambda owner: False) == []  # lease still valid: nobody's business
    clock.t += 11
    assert store.reap(lambda owner: False) == []  # re-queued, not ended
    again = store.get(job_id)
    assert again is not None and again.status == "queued" and again.lease_owner is None
    job = store.claim("w2", "cpu", 10.0)
    assert job is not None and job.attempts == 2 and job.lease_owner == "w2#2"
    clock.t += 11
    ended = store.reap(lambda owner: False)
    assert [j.id for j in ended] == [job_id]
    assert ended[0].status == "failed" and ended[0].error is not None
    assert "worker lost 2 times" in ended[0].error["detail"]


def test_the_database_clock_expires_leases_when_none_is_given(pg_url: str) -> None:
    s = PostgresJobStore(pg_url)
    s.init()
    job_id = add(s)[0].id
    job = s.claim("w", "cpu", 0.05)
    assert job is not None
    import time
    time.sleep(0.1)
    s.reap(lambda owner: False)
    rec = s.get(job_id)
    assert rec is not None and rec.status == "queued"
    s.close()


def test_a_lost_lease_fences_the_old_owner(store: PostgresJobStore, clock: Clock) -> None:
    job_id = add(store)[0].id
    old = store.claim("w1", "cpu", 10.0)
    assert old is not None
    clock.t += 11
    store.reap(lambda owner: False)
    new = store.claim("w2", "cpu", 10.0)
    assert new is not None and new.id == job_id
    ran: list[str] = []
    assert store.heartbeat(job_id, "w1#1", 10.0, None) == "lost"
    assert not store.complete(job_id, "w1#1", {"x": 1}, before_commit=lambda: ran.append("old"))
    assert ran == []  # the old owner never installs files
    assert store.heartbeat(job_id, "w2#2", 10.0, {"tensors_done": 1}) == "ok"
    assert store.complete(job_id, "w2#2", {"x": 2}, before_commit=lambda: ran.append("new"))
    rec = store.get(job_id)
    assert ran == ["new"] and rec is not None and rec.status == "succeeded" and rec.result == {"x": 2}


def test_cancel_of_a_running_job_is_seen_by_its_heartbeat(store: PostgresJobStore) -> None:
    queued = add(store)[0].id
    running = add(store)[0].id
    store.claim("w", "cpu", 10.0)  # the older one
    rec = store.request_cancel(queued)
    assert rec is not None and rec.status == "running"  # (the older one was claimed)
    other = store.request_cancel(running)
    assert other is not None and other.status == "cancelled"
    assert store.heartbeat(queued, "w#1", 10.0, None) == "cancel"
    assert not store.complete(queued, "w#1", {})
    assert store.finish_cancelled(queued, "w#1")


def test_release_gives_the_attempt_back(store: PostgresJobStore) -> None:
    job_id = add(store)[0].id
    store.claim("w", "cpu", 10.0)
    store.heartbeat(job_id, "w#1", 10.0, {"tensors_done": 2, "tensors_total": 4, "fraction": 0.5})
    assert store.release(job_id, "w#1")
    rec = store.get(job_id)
    assert rec is not None and (rec.status, rec.attempts) == ("queued", 0)
    assert rec.progress["tensors_done"] == 0 and rec.progress["tensors_total"] == 4


def test_idempotency_keys_per_tenant_and_concurrent_replays(pg_url: str) -> None:
    stores = [PostgresJobStore(pg_url) for _ in range(4)]
    stores[0].init()
    results: list[tuple[Any, bool]] = []
    lock = threading.Lock()

    def submit(i: int) -> None:
        r = add(stores[i], key="k1")
        with lock:
            results.append(r)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(created for _, created in results) == 1
    assert len({rec.id for rec, _ in results}) == 1
    other, created = add(stores[0], tenant="u", key="k1")
    assert created and other.id != results[0][0].id
    assert [j.id for j in stores[0].list_jobs("u", status=None, limit=10, after=None)] == [other.id]
    for s in stores:
        s.close()


def test_a_failing_before_commit_inserts_nothing(store: PostgresJobStore) -> None:
    def boom() -> None:
        raise OSError("bucket unreachable")

    with pytest.raises(OSError):
        add(store, before_commit=boom)
    assert store.counts_by_status()["queued"] == 0


def test_queue_full(store: PostgresJobStore) -> None:
    add(store, max_queue=1)
    with pytest.raises(QueueFull) as e:
        add(store, max_queue=1)
    assert e.value.retry_after == 7


def test_listing_pages_newest_first(store: PostgresJobStore, clock: Clock) -> None:
    ids = []
    for _ in range(5):
        clock.t += 1
        ids.append(add(store)[0].id)
    page = store.list_jobs("t", status=None, limit=2, after=None)
    assert [j.id for j in page] == ids[::-1][:2]
    rest = store.list_jobs("t", status="queued", limit=10, after=(page[-1].created_at, page[-1].id))
    assert [j.id for j in rest] == ids[::-1][2:]
    assert store.known_ids([ids[0], "f" * 32]) == {ids[0]}
    assert store.queue_depth() == 5 and store.succeeded_input_bytes() == 0


def test_expiry_and_workers(store: PostgresJobStore, clock: Clock) -> None:
    job_id = add(store)[0].id
    store.claim("w", "cpu", 10.0)
    store.fail(job_id, "w#1", {"type": "x", "title": "x", "detail": "x"})
    assert store.expire_due(100.0) == []
    clock.t += 101
    assert store.expire_due(100.0) == [job_id]
    store.mark_expired(job_id)
    assert store.expire_due(100.0) == []
    store.register_worker("host/1/b/w0", "cpu")
    store.worker_heartbeat("host/1/b/w0", job_id)
    assert [w["busy_job"] for w in store.live_workers(5.0)] == [job_id]
    clock.t += 10
    assert store.live_workers(5.0) == [] and store.prune_workers(5.0) == 1


def test_every_change_is_notified(store: PostgresJobStore, pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"LISTEN {CHANNEL}")
        job_id = add(store)[0].id
        store.claim("w", "cpu", 10.0)
        store.heartbeat(job_id, "w#1", 10.0, {"tensors_done": 1})
        store.complete(job_id, "w#1", {})
        seen = [n.payload for n in conn.notifies(timeout=2.0, stop_after=4)]
    assert seen == [job_id] * 4


def test_quantd_db_upgrade_command(pg_url: str, tmp_path: Any) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "QUANTD_DATABASE_URL": pg_url, "QUANTD_DATA_DIR": str(tmp_path)}
    run = [sys.executable, "-m", "quantd", "db", "upgrade"]
    first = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert f"applied migration(s) {list(range(1, LATEST + 1))}" in first.stdout
    assert "@" not in first.stdout.split(":", 2)[1]  # the URL is shown without its credentials
    again = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "schema up to date" in again.stdout
    assert schema_version(pg_url) == LATEST
    bad = subprocess.run(run, env={**env, "QUANTD_DATABASE_URL": "mysql://x/y"}, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "database_url must start with" in bad.stderr


def test_serve_on_an_unmigrated_or_unreachable_database_says_why_in_one_line(pg_url: str, tmp_path: Any) -> None:
    import os
    import subprocess
    import sys

    from servers import free_port

    env = {**os.environ, "QUANTD_DATA_DIR": str(tmp_path), "QUANTD_WARMUP": "0", "QUANTD_DB_MIGRATE": "0"}
    for url, says in ((pg_url, "run `quantd db upgrade`"),
                      (f"postgresql://quantd@127.0.0.1:{free_port()}/none", "the database cannot be reached")):
        for cmd in (["serve", "--port", str(free_port())], ["worker"]):
            r = subprocess.run([sys.executable, "-m", "quantd", *cmd], env={**env, "QUANTD_DATABASE_URL": url},
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 1 and says in r.stderr, (cmd, r.stderr[-2000:])
            assert "Traceback" not in r.stderr, (cmd, r.stderr[-2000:])
