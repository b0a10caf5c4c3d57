"""The durable job table: the ``JobStore`` interface and its SQLite (WAL) implementation.

The queue is the store's ``claim``: one ``UPDATE ... WHERE id = (SELECT ... LIMIT 1) RETURNING`` inside
``BEGIN IMMEDIATE``, so two workers (threads or processes) never claim the same job. The attempt is
counted at claim; the lease owner is ``{worker_id}#{attempt}``, so a worker whose lease was lost
cannot complete, fail or heartbeat a job that has since been re-claimed (a fencing token).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, Protocol

from .errors import QueueFull
from .records import STATUSES, JobRecord

LeaseState = Literal["ok", "cancel", "lost"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('queued','running','succeeded','failed','cancelled')),
    config TEXT NOT NULL,
    input TEXT NOT NULL,
    calibration TEXT,
    progress TEXT NOT NULL DEFAULT '{}',
    result TEXT,
    error TEXT,
    device TEXT,
    attempts INTEGER NOT NULL DEFAULT 0,
    max_attempts INTEGER NOT NULL,
    lease_owner TEXT,
    lease_expires_at REAL,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    heartbeat_at REAL,
    idempotency_key TEXT,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    expired_at REAL,
    UNIQUE (tenant, idempotency_key)
);
CREATE INDEX IF NOT EXISTS jobs_queue ON jobs (status, created_at);
CREATE INDEX IF NOT EXISTS jobs_tenant ON jobs (tenant, created_at DESC, id DESC);
CREATE TABLE IF NOT EXISTS workers (
    id TEXT PRIMARY KEY,
    device TEXT NOT NULL,
    started_at REAL NOT NULL,
    heartbeat_at REAL NOT NULL,
    busy_job TEXT
);
PRAGMA user_version = 1;
"""


class JobStore(Protocol):
    """The job table and the queue. A PostgreSQL backend implements the same calls
    (``FOR UPDATE SKIP LOCKED`` in place of ``BEGIN IMMEDIATE``)."""

    def init(self) -> None: ...
    def close(self) -> None: ...
    def ping(self) -> bool: ...
    def insert(self, *, job_id: str, tenant: str, config: dict[str, Any], input: dict[str, Any],
               calibration: dict[str, Any] | None, idempotency_key: str | None, max_attempts: int,
               max_queue: int, retry_after: int,
               before_commit: Callable[[], None], device: str | None = None,
               progress: dict[str, Any] | None = None) -> tuple[JobRecord, bool]: ...
    def get(self, job_id: str) -> JobRecord | None: ...
    def list_jobs(self, tenant: str, *, status: str | None, limit: int,
             after: tuple[float, str] | None) -> list[JobRecord]: ...
    def claim(self, worker_id: str, device: str, lease_s: float) -> JobRecord | None: ...
    def heartbeat(self, job_id: str, owner: str, lease_s: float,
                  progress: dict[str, Any] | None) -> LeaseState: ...
    def lease_state(self, job_id: str, owner: str) -> LeaseState: ...
    def complete(self, job_id: str, owner: str, result: dict[str, Any],
                 before_commit: Callable[[], None] | None = None) -> bool: ...
    def fail(self, job_id: str, owner: str, error: dict[str, Any]) -> bool: ...
    def finish_cancelled(self, job_id: str, owner: str) -> bool: ...
    def release(self, job_id: str, owner: str) -> bool: ...
    def request_cancel(self, job_id: str) -> JobRecord | None: ...
    def reap(self, is_dead: Callable[[str], bool]) -> list[JobRecord]: ...
    def expire_due(self, ttl_s: float) -> list[str]: ...
    def mark_expired(self, job_id: str) -> None: ...
    def known_ids(self, ids: list[str]) -> set[str]: ...
    def queue_depth(self) -> int: ...
    def counts_by_status(self) -> dict[str, int]: ...
    def succeeded_input_bytes(self) -> int: ...
    def register_worker(self, worker_id: str, device: str) -> None: ...
    def worker_heartbeat(self, worker_id: str, busy_job: str | None) -> None: ...
    def unregister_worker(self, worker_id: str) -> None: ...
    def live_workers(self, within_s: float) -> list[dict[str, Any]]: ...
    def prune_workers(self, older_than_s: float) -> int: ...


# A job back in the queue starts its progress counts again and keeps its totals, so its event stream never
# shows a total of 0.
_PROGRESS_RESTART = ("json_set(COALESCE(progress, '{}'), '$.tensors_done', 0, '$.bytes_done', 0,"
                     " '$.fraction', 0.0)")


def _js(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"))


def worker_lost_error(attempts: int) -> dict[str, str]:
    return {"type": "urn:quantd:worker-lost", "title": "Worker lost",
            "detail": f"worker lost {attempts} times (lease expired or worker process died); "
                      "giving up after max_attempts"}


class SQLiteJobStore:
    """One connection per store object, serialised by a lock; other processes (and other store
    objects) coordinate through SQLite's own locking (WAL, ``busy_timeout``)."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time, busy_timeout_ms: int = 15000):
        self.path = Path(path)
        self.clock = clock
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                                     timeout=busy_timeout_ms / 1000)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")

    def init(self) -> None:
        with self._lock:
            self._conn.execute("PRAGMA journal_mode = WAL")
            self._conn.execute("PRAGMA synchronous = FULL")  # an accepted job survives power loss too
            self._conn.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    def ping(self) -> bool:
        try:
            return bool(self._read("SELECT 1")[0][0] == 1)
        except sqlite3.Error:
            return False

    # -- submission and reads --------------------------------------------------------------
    def insert(self, *, job_id: str, tenant: str, config: dict[str, Any], input: dict[str, Any],
               calibration: dict[str, Any] | None, idempotency_key: str | None, max_attempts: int,
               max_queue: int, retry_after: int,
               before_commit: Callable[[], None], device: str | None = None,
               progress: dict[str, Any] | None = None) -> tuple[JobRecord, bool]:
        """Insert a queued job, or return the tenant's job with the same idempotency key
        (``created`` False). ``before_commit`` (moving the upload in place) runs inside the
        transaction: if it fails, nothing is inserted."""
        with self._tx() as db:
            if idempotency_key is not None:
                row = db.execute("SELECT * FROM jobs WHERE tenant = ? AND idempotency_key = ?",
                                 (tenant, idempotency_key)).fetchone()
                if row is not None:
                    return JobRecord.from_row(row), False
            depth = db.execute("SELECT COUNT(*) FROM jobs WHERE status = 'queued'").fetchone()[0]
            if depth >= max_queue:
                raise QueueFull(f"{depth} jobs queued (max_queue {max_queue}); retry later",
                                retry_after=retry_after)
            row = db.execute(
                "INSERT INTO jobs (id, tenant, status, config, input, calibration, max_attempts, created_at,"
                " idempotency_key, device, progress) VALUES (?, ?, 'queued', ?, ?, ?, ?, ?, ?, ?, ?) RETURNING *",
                (job_id, tenant, _js(config), _js(input), _js(calibration), max_attempts, self.clock(),
                 idempotency_key, device, _js(progress or {}))).fetchone()
            before_commit()
            return JobRecord.from_row(row), True

    def get(self, job_id: str) -> JobRecord | None:
        rows = self._read("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return JobRecord.from_row(rows[0]) if rows else None

    def list_jobs(self, tenant: str, *, status: str | None, limit: int,
             after: tuple[float, str] | None) -> list[JobRecord]:
        """Newest first; ``after`` = (created_at, id) of the last job of the previous page."""
        sql, args = "SELECT * FROM jobs WHERE tenant = ?", list[Any]([tenant])
        if status is not None:
            sql += " AND status = ?"
            args.append(status)
        if after is not None:
            sql += " AND (created_at < ? OR (created_at = ? AND id < ?))"
            args += [after[0], after[0], after[1]]
        sql += " ORDER BY created_at DESC, id DESC LIMIT ?"
        return [JobRecord.from_row(r) for r in self._read(sql, (*args, limit))]

    def known_ids(self, ids: list[str]) -> set[str]:
        if not ids:
            return set()
        rows = self._read("SELECT id FROM jobs WHERE id IN (SELECT value FROM json_each(?))", (json.dumps(ids),))
        return {r[0] for r in rows}

    def queue_depth(self) -> int:
        return int(self._read("SELECT COUNT(*) FROM jobs WHERE status = 'queued'")[0][0])

    def counts_by_status(self) -> dict[str, int]:
        counts = dict.fromkeys(STATUSES, 0)
        for row in self._read("SELECT status, COUNT(*) FROM jobs GROUP BY status"):
            counts[row[0]] = row[1]
        return counts

    def succeeded_input_bytes(self) -> int:
        """Input bytes of every job that succeeded (rows are never deleted: this only grows)."""
        rows = self._read("SELECT COALESCE(SUM(json_extract(input, '$.bytes')), 0) FROM jobs WHERE status = 'succeeded'")
        return int(rows[0][0])

    # -- the worker side -------------------------------------------------------------------
    def claim(self, worker_id: str, device: str, lease_s: float) -> JobRecord | None:
        if not self._read("SELECT 1 FROM jobs WHERE status = 'queued' LIMIT 1"):
            return None  # cheap read first: idle workers do not take the write lock
        now = self.clock()
        with self._tx() as db:
            row = db.execute(
                "UPDATE jobs SET status = 'running', attempts = attempts + 1,"
                " lease_owner = ? || '#' || (attempts + 1), lease_expires_at = ?, device = ?,"
                " started_at = COALESCE(started_at, ?), heartbeat_at = ?"
                " WHERE id = (SELECT id FROM jobs WHERE status = 'queued' ORDER BY created_at, rowid LIMIT 1)"
                " RETURNING *",
                (worker_id, now + lease_s, device, now, now)).fetchone()
        return None if row is None else JobRecord.from_row(row)

    def heartbeat(self, job_id: str, owner: str, lease_s: float,
                  progress: dict[str, Any] | None) -> LeaseState:
        """Extend the lease (and store progress); says whether a cancel was asked or the lease lost."""
        now = self.clock()
        with self._tx() as db:
            row = db.execute(
                "UPDATE jobs SET lease_expires_at = ?, heartbeat_at = ?, progress = COALESCE(?, progress)"
                " WHERE id = ? AND lease_owner = ? AND status = 'running' RETURNING cancel_requested",
                (now + lease_s, now, _js(progress), job_id, owner)).fetchone()
        if row is None:
            return "lost"
        return "cancel" if row[0] else "ok"

    def lease_state(self, job_id: str, owner: str) -> LeaseState:
        rows = self._read("SELECT cancel_requested FROM jobs WHERE id = ? AND lease_owner = ?"
                          " AND status = 'running'", (job_id, owner))
        if not rows:
            return "lost"
        return "cancel" if rows[0][0] else "ok"

    def _finish(self, job_id: str, owner: str, status: str, *, result: dict[str, Any] | None = None,
                error: dict[str, Any] | None = None, extra_where: str = "",
                before_commit: Callable[[], None] | None = None) -> bool:
        with self._tx() as db:
            row = db.execute(
                "UPDATE jobs SET status = ?, result = ?, error = ?, finished_at = ?, lease_owner = NULL,"
                " lease_expires_at = NULL WHERE id = ? AND lease_owner = ? AND status = 'running'"
                f"{extra_where} RETURNING id",
                (status, _js(result), _js(error), self.clock(), job_id, owner)).fetchone()
            if row is not None and before_commit is not None:
                before_commit()
        return row is not None

    def complete(self, job_id: str, owner: str, result: dict[str, Any],
                 before_commit: Callable[[], None] | None = None) -> bool:
        """Late acknowledgement, once artifact and report are ready. False when the lease was lost or a
        cancel was asked meanwhile. ``before_commit`` (moving artifact and report into place) runs in the
        same transaction, after the lease is found held: the lease owner is a fencing token, and a worker
        that lost its lease (stalled past it while another finished the job) never replaces the files
        of the job it no longer owns. If it raises, the job stays running (files it already moved stay
        moved: the attempt that finishes the job replaces them)."""
        return self._finish(job_id, owner, "succeeded", result=result, extra_where=" AND cancel_requested = 0",
                            before_commit=before_commit)

    def fail(self, job_id: str, owner: str, error: dict[str, Any]) -> bool:
        return self._finish(job_id, owner, "failed", error=error)

    def finish_cancelled(self, job_id: str, owner: str) -> bool:
        return self._finish(job_id, owner, "cancelled")

    def release(self, job_id: str, owner: str) -> bool:
        """Give a job back to the queue on a graceful shutdown: the attempt is not counted."""
        with self._tx() as db:
            row = db.execute(
                "UPDATE jobs SET status = 'queued', attempts = attempts - 1, lease_owner = NULL,"
                " lease_expires_at = NULL, device = NULL, progress = " + _PROGRESS_RESTART +
                " WHERE id = ? AND lease_owner = ? AND status = 'running' RETURNING id",
                (job_id, owner)).fetchone()
        return row is not None

    # -- cancellation, recovery, expiry ------------------------------------------------------
    def request_cancel(self, job_id: str) -> JobRecord | None:
        """queued → cancelled now; running → ``cancel_requested`` (the worker ends it)."""
        with self._tx() as db:
            db.execute("UPDATE jobs SET status = 'cancelled', finished_at = ?, cancel_requested = 1"
                       " WHERE id = ? AND status = 'queued'", (self.clock(), job_id))
            db.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ? AND status = 'running'", (job_id,))
            row = db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else JobRecord.from_row(row)

    def reap(self, is_dead: Callable[[str], bool]) -> list[JobRecord]:
        """Running jobs whose lease expired or whose owner is known dead: re-queued, or failed
        after ``max_attempts`` (cancelled when a cancel was asked). Returns the jobs it ended."""
        now, ended = self.clock(), []
        with self._tx() as db:
            rows = db.execute("SELECT id, lease_owner, lease_expires_at, attempts, max_attempts,"
                              " cancel_requested FROM jobs WHERE status = 'running'").fetchall()
            for r in rows:
                if r["lease_expires_at"] >= now and not is_dead(r["lease_owner"]):
                    continue
                if r["cancel_requested"]:
                    status, error = "cancelled", None
                elif r["attempts"] >= r["max_attempts"]:
                    status, error = "failed", worker_lost_error(r["attempts"])
                else:
                    db.execute("UPDATE jobs SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL,"
                               " device = NULL, progress = " + _PROGRESS_RESTART + " WHERE id = ?", (r["id"],))
                    continue
                row = db.execute("UPDATE jobs SET status = ?, error = ?, finished_at = ?, lease_owner = NULL,"
                                 " lease_expires_at = NULL WHERE id = ? RETURNING *",
                                 (status, _js(error), now, r["id"])).fetchone()
                ended.append(JobRecord.from_row(row))
        return ended

    def expire_due(self, ttl_s: float) -> list[str]:
        rows = self._read("SELECT id FROM jobs WHERE status IN ('succeeded','failed','cancelled')"
                          " AND expired_at IS NULL AND finished_at < ?", (self.clock() - ttl_s,))
        return [r[0] for r in rows]

    def mark_expired(self, job_id: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE jobs SET expired_at = ? WHERE id = ? AND expired_at IS NULL",
                       (self.clock(), job_id))

    # -- worker registry (readiness, busy workers) -------------------------------------------
    def register_worker(self, worker_id: str, device: str) -> None:
        now = self.clock()
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO workers (id, device, started_at, heartbeat_at) VALUES (?,?,?,?)",
                       (worker_id, device, now, now))

    def worker_heartbeat(self, worker_id: str, busy_job: str | None) -> None:
        with self._tx() as db:
            db.execute("UPDATE workers SET heartbeat_at = ?, busy_job = ? WHERE id = ?",
                       (self.clock(), busy_job, worker_id))

    def unregister_worker(self, worker_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM workers WHERE id = ?", (worker_id,))

    def live_workers(self, within_s: float) -> list[dict[str, Any]]:
        rows = self._read("SELECT * FROM workers WHERE heartbeat_at >= ?", (self.clock() - within_s,))
        return [dict(r) for r in rows]

    def prune_workers(self, older_than_s: float) -> int:
        """Forget workers silent for ``older_than_s`` (processes that died without unregistering)."""
        with self._tx() as db:
            return db.execute("DELETE FROM workers WHERE heartbeat_at < ?", (self.clock() - older_than_s,)).rowcount
