"""The SQLite job store: atomic claim, leases, fencing, reaping, cancellation, expiry."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from quantd.jobs import QueueFull, SQLiteJobStore


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def add(store: SQLiteJobStore, *, tenant: str = "t", key: str | None = None, max_attempts: int = 3,
        max_queue: int = 10_000) -> tuple[Any, bool]:
    return store.insert(job_id=uuid.uuid4().hex, tenant=tenant, config={}, input={"filename": "m", "bytes": 1,
                        "sha256": "0" * 64, "format": "safetensors", "tensors": 1}, calibration=None,
                        idempotency_key=key, max_attempts=max_attempts, max_queue=max_queue, retry_after=7,
                        before_commit=lambda: None)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Any:
    s = SQLiteJobStore(tmp_path / "quantd.db", clock=clock)
    s.init()
    yield s
    s.close()


def test_claim_is_atomic_across_connections(tmp_path: Path) -> None:
    """Two threads, each with its own connection (as two processes would have), drain 60 jobs:
    every job is claimed exactly once, with attempt 1."""
    stores = [SQLiteJobStore(tmp_path / "quantd.db") for _ in range(2)]
    stores[0].init()
    ids = {add(stores[0])[0].id for _ in range(60)}
    claimed: list[list[Any]] = [[], []]

    def drain(i: int) -> None:
        while (job := stores[i].claim(f"w{i}", "cpu", 30.0)) is not None:
            claimed[i].append(job)

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = [j.id for part in claimed for j in part]
    assert sorted(got) == sorted(ids)
    assert len(set(got)) == len(got)
    assert all(j.attempts == 1 and j.status == "running" for part in claimed for j in part)
    for s in stores:
        s.close()


def test_claim_takes_the_oldest_and_counts_the_attempt(store: SQLiteJobStore, clock: Clock) -> None:
    first = add(store)[0]
    clock.t += 1
    add(store)
    job = store.claim("w", "cuda:1", 30.0)
    assert job is not None and job.id == first.id
    assert (job.attempts, job.device, job.lease_owner) == (1, "cuda:1", "w#1")
    assert job.lease_expires_at == pytest.approx(clock.t + 30.0)


def test_expired_lease_requeued_then_failed_after_max_attempts(store: SQLiteJobStore, clock: Clock) -> None:
    job_id = add(store, max_attempts=3)[0].id
    for attempt in (1, 2):
        job = store.claim("w", "cpu", 10.0)
        assert job is not None and job.attempts == attempt
        clock.t += 5
        assert store.reap(lambda owner: False) == []
        assert store.get(job_id).status == "running"  # lease still valid
        clock.t += 6
        assert store.reap(lambda owner: False) == []
        assert store.get(job_id).status == "queued"
    store.claim("w", "cpu", 10.0)
    clock.t += 11
    ended = store.reap(lambda owner: False)
    assert [j.id for j in ended] == [job_id]
    rec = store.get(job_id)
    assert rec.status == "failed" and rec.attempts == 3 and rec.finished_at == clock.t
    assert rec.error["type"] == "urn:quantd:worker-lost"
    assert "worker lost 3 times" in rec.error["detail"]


def test_dead_owner_requeued_before_its_lease_expires(store: SQLiteJobStore) -> None:
    job_id = add(store)[0].id
    store.claim("dead-worker", "cpu", 1000.0)
    store.reap(lambda owner: owner.startswith("alive"))
    assert store.get(job_id).status == "running"
    store.reap(lambda owner: owner == "dead-worker#1")
    assert store.get(job_id).status == "queued"


def test_lost_lease_cannot_complete_or_heartbeat(store: SQLiteJobStore, clock: Clock) -> None:
    """Fencing: worker A's lease expires, B re-claims; A's late writes are refused."""
    job_id = add(store)[0].id
    a = store.claim("A", "cpu", 10.0)
    clock.t += 11
    store.reap(lambda owner: False)
    b = store.claim("B", "cpu", 10.0)
    assert a is not None and b is not None and b.attempts == 2
    assert store.heartbeat(job_id, a.lease_owner, 10.0, {"tensors_done": 9}) == "lost"
    assert not store.complete(job_id, a.lease_owner, {"artifact_bytes": 1})
    assert not store.fail(job_id, a.lease_owner, {"type": "x", "title": "x", "detail": "x"})
    assert store.heartbeat(job_id, b.lease_owner, 10.0, {"tensors_done": 1}) == "ok"
    assert store.complete(job_id, b.lease_owner, {"artifact_bytes": 2})
    rec = store.get(job_id)
    assert rec.status == "succeeded" and rec.result == {"artifact_bytes": 2} and rec.progress == {"tensors_done": 1}


def test_heartbeat_extends_the_lease(store: SQLiteJobStore, clock: Clock) -> None:
    job_id = add(store)[0].id
    job = store.claim("w", "cpu", 10.0)
    clock.t += 8
    assert store.heartbeat(job_id, job.lease_owner, 10.0, None) == "ok"
    clock.t += 8  # 16 s after the claim, 8 after the heartbeat
    store.reap(lambda owner: False)
    assert store.get(job_id).status == "running"


def test_cancel_queued_and_running(store: SQLiteJobStore, clock: Clock) -> None:
    running_id = add(store)[0].id
    clock.t += 1
    queued_id = add(store)[0].id
    job = store.claim("w", "cpu", 10.0)
    assert store.request_cancel(queued_id).status == "cancelled"
    assert store.claim("w2", "cpu", 10.0) is None  # a cancelled job is never claimed
    after = store.request_cancel(running_id)
    assert after.status == "running" and after.cancel_requested
    assert store.heartbeat(running_id, job.lease_owner, 10.0, None) == "cancel"
    assert not store.complete(running_id, job.lease_owner, {})  # no success after a cancel was asked
    assert store.finish_cancelled(running_id, job.lease_owner)
    assert store.get(running_id).status == "cancelled"


def test_expired_lease_of_cancelled_job_ends_cancelled(store: SQLiteJobStore, clock: Clock) -> None:
    job_id = add(store)[0].id
    store.claim("w", "cpu", 10.0)
    store.request_cancel(job_id)
    clock.t += 11
    assert [j.status for j in store.reap(lambda owner: False)] == ["cancelled"]


def test_release_gives_the_attempt_back(store: SQLiteJobStore) -> None:
    job_id = add(store)[0].id
    job = store.claim("w", "cpu", 10.0)
    assert store.release(job_id, job.lease_owner)
    rec = store.get(job_id)
    assert (rec.status, rec.attempts, rec.lease_owner) == ("queued", 0, None)


def test_idempotency_key_per_tenant(store: SQLiteJobStore) -> None:
    first, created = add(store, key="k")
    again, created_again = add(store, key="k")
    other, other_created = add(store, tenant="other", key="k")
    assert created and not created_again and other_created
    assert again.id == first.id and other.id != first.id
    assert store.counts_by_status()["queued"] == 2


def test_queue_full(store: SQLiteJobStore) -> None:
    add(store, max_queue=2)
    add(store, max_queue=2)
    with pytest.raises(QueueFull) as e:
        add(store, max_queue=2)
    assert type(e.value) is QueueFull and e.value.retry_after == 7
    assert store.queue_depth() == 2


def test_failed_before_commit_inserts_nothing(store: SQLiteJobStore) -> None:
    def boom() -> None:
        raise OSError("disk full")

    with pytest.raises(OSError):
        store.insert(job_id=uuid.uuid4().hex, tenant="t", config={}, input={}, calibration=None,
                     idempotency_key=None, max_attempts=3, max_queue=10, retry_after=1, before_commit=boom)
    assert store.queue_depth() == 0


def test_expire_due_only_old_finished_jobs(store: SQLiteJobStore, clock: Clock) -> None:
    old = add(store)[0].id
    job = store.claim("w", "cpu", 10.0)
    store.fail(old, job.lease_owner, {"type": "x", "title": "x", "detail": "x"})
    queued = add(store)[0].id
    clock.t += 100
    assert store.expire_due(ttl_s=200) == []
    clock.t += 101
    assert store.expire_due(ttl_s=200) == [old]
    store.mark_expired(old)
    assert store.expire_due(ttl_s=200) == []
    assert store.get(queued).expired_at is None


def test_worker_registry(store: SQLiteJobStore, clock: Clock) -> None:
    store.register_worker("a", "cpu")
    clock.t += 20
    store.register_worker("b", "cuda:0")
    store.worker_heartbeat("b", "job1")
    assert [(w["id"], w["busy_job"]) for w in store.live_workers(10.0)] == [("b", "job1")]
    assert store.prune_workers(15.0) == 1  # "a", silent for 20 s
    assert store.live_workers(100.0) == [store.live_workers(10.0)[0]]
    store.unregister_worker("b")
    assert store.live_workers(10.0) == []


def test_a_requeued_job_keeps_its_progress_totals(store: SQLiteJobStore, clock: Clock) -> None:
    # Re-queued (lease expired) or released, a job keeps its progress totals; the done counts restart.
    job_id = add(store)[0].id
    a = store.claim("A", "cpu", 10.0)
    assert a is not None
    store.heartbeat(job_id, a.lease_owner, 10.0, {"tensors_done": 3, "tensors_total": 8, "bytes_done": 30,
                                                  "bytes_total": 80, "fraction": 0.375})
    clock.t += 11
    store.reap(lambda owner: False)
    assert store.get(job_id).progress == {"tensors_done": 0, "tensors_total": 8, "bytes_done": 0,
                                          "bytes_total": 80, "fraction": 0.0}
    b = store.claim("B", "cpu", 10.0)
    assert b is not None and store.release(job_id, b.lease_owner)
    assert store.get(job_id).progress["tensors_total"] == 8


def test_a_stored_config_that_todays_rules_refuse_is_still_shown(tmp_path: Path) -> None:
    """An older release took a NaN method argument; reading that job back must not fail (a 500 on its GET
    and on every listing page it is on)."""
    import math

    store = SQLiteJobStore(tmp_path / "q.db")
    store.init()
    job_id = uuid.uuid4().hex
    config = {"scheme": {"dtype": "int4", "method": "gptq", "method_args": {"damp": math.nan}}}
    store.insert(job_id=job_id, tenant="t", config=config, input={"filename": "m", "bytes": 5, "sha256": "0" * 64,
                 "format": "safetensors", "tensors": 1}, calibration=None, idempotency_key=None, max_attempts=3,
                 max_queue=10, retry_after=1, before_commit=lambda: None)
    record = store.get(job_id)
    assert record is not None
    job = record.to_job()
    assert math.isnan(job.config.scheme.method_args["damp"])
    store.close()
