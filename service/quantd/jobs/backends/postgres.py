"""The job table and queue on PostgreSQL (psycopg 3), for API replicas and workers on many hosts.

The same guarantees as the SQLite store: a job row is committed before its 202; a worker claims the oldest
queued job with ``FOR UPDATE SKIP LOCKED`` (two workers never take the same row, and neither waits for the
other), counting the attempt at claim; the lease owner ``{worker_id}#{attempt}`` is a fencing token for
heartbeats and the late acknowledgement. Lease times come from the database's clock, so hosts whose clocks
disagree still agree on when a lease expired; whoever notices an expired lease re-queues the job (no process
ids are compared across hosts). Every change of a job's row is announced with ``NOTIFY quantd_jobs`` so that
event streams on any replica wake at once.

Schema changes are numbered migrations (:data:`MIGRATIONS`), applied in order under an advisory lock by
``quantd db upgrade`` and at start; each runs once, recorded in ``quantd_schema``.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.rows import dict_row

from ..errors import DatabaseUnavailable, QueueFull, StorageError
from ..records import STATUSES, JobRecord
from ..store import LeaseState, worker_lost_error

log = logging.getLogger("quantd.jobs")

CHANNEL = "quantd_jobs"
# An arbitrary constant: the advisory lock that serialises migrations between processes starting together.
_MIGRATION_LOCK = 0x71A4D7

MIGRATIONS: list[tuple[int, str, str]] = [
    (1, "jobs and workers", """
CREATE TABLE jobs (
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
    lease_expires_at DOUBLE PRECISION,
    created_at DOUBLE PRECISION NOT NULL,
    started_at DOUBLE PRECISION,
    finished_at DOUBLE PRECISION,
    heartbeat_at DOUBLE PRECISION,
    idempotency_key TEXT,
    cancel_requested BOOLEAN NOT NULL DEFAULT false,
    expired_at DOUBLE PRECISION,
    seq BIGSERIAL NOT NULL,
    UNIQUE (tenant, idempotency_key)
);
CREATE INDEX jobs_queue ON jobs (created_at, seq) WHERE status = 'queued';
CREATE INDEX jobs_running ON jobs (lease_expires_at) WHERE status = 'running';
CREATE INDEX jobs_tenant ON jobs (tenant, created_at DESC, id DESC);
CREATE INDEX jobs_finished ON jobs (finished_at) WHERE expired_at IS NULL;
CREATE TABLE workers (
    id TEXT PRIMARY KEY,
    device TEXT NOT NULL,
    started_at DOUBLE PRECISION NOT NULL,
    heartbeat_at DOUBLE PRECISION NOT NULL,
    busy_job TEXT
);
"""),
]
LATEST = MIGRATIONS[-1][0]

# The database's clock unless the store was given one (tests): every host's lease expires on the same clock.
_NOW = "COALESCE(%(now)s::float8, EXTRACT(EPOCH FROM clock_timestamp())::float8)"
# A job back in the queue starts its progress again, keeping its totals.
_PROGRESS_RESTART = ("(COALESCE(progress, '{}')::jsonb || '{\"tensors_done\": 0, \"bytes_done\": 0,"
                     " \"fraction\": 0.0}'::jsonb)::text")


def _js(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"))


@contextmanager
def _admin(conninfo: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection of its own for the schema's checks and migrations; DatabaseUnavailable (with the driver's
    reason, which names the host and never the password) when the database cannot be reached."""
    try:
        conn = psycopg.connect(conninfo, autocommit=True, connect_timeout=10)
    except psycopg.OperationalError as e:
        raise DatabaseUnavailable(f"the database cannot be reached: {str(e).strip()}") from e
    with conn:
        yield conn


def upgrade(conninfo: str) -> list[int]:
    """Apply the migrations this database lacks, in order, under an advisory lock; returns those applied."""
    applied: list[int] = []
    with _admin(conninfo) as conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS quantd_schema (version INTEGER PRIMARY KEY,"
                     " description TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())")
        done = {r[0] for r in conn.execute("SELECT version FROM quantd_schema").fetchall()}
        _check_not_newer(max(done, default=0))
        for version, description, sql in MIGRATIONS:
            if version in done:
                continue
            conn.execute(sql)  # constant DDL from this module
            conn.execute("INSERT INTO quantd_schema (version, description) VALUES (%s, %s)", (version, description))
            applied.append(version)
            log.info("database migration %d applied: %s", version, description)
    return applied


def _check_not_newer(version: int) -> None:
    if version > LATEST:
        raise StorageError(f"the database schema is at version {version}, newer than this quantd's ({LATEST}): a "
                           "newer release migrated it; run that release, or one at least as new")


def schema_version(conninfo: str) -> int:
    """The newest migration applied (0 for a database quantd has not touched)."""
    with _admin(conninfo) as conn:
        if conn.execute("SELECT to_regclass('quantd_schema')").fetchone() == (None,):
            return 0
        row = conn.execute("SELECT COALESCE(MAX(version), 0) FROM quantd_schema").fetchone()
        return int(row[0]) if row else 0


# A pooled connection idle this long is checked (``SELECT 1``) before it is lent: after a database restart or
# a dropped connection, every pooled one is dead, and each would otherwise fail one request or job step.
_CHECK_IDLE_S = 1.0


class PostgresJobStore:
    """A small pool of connections (``pool_size``), each used by one thread at a time; a blocking call
    borrows one for its transaction. ``clock`` None = the database's clock. A connection that cannot be made,
    or is lost under a call, raises :class:`DatabaseUnavailable` (503 to a client; a worker retries)."""

    def __init__(self, conninfo: str, *, clock: Callable[[], float] | None = None, pool_size: int = 8,
                 connect_timeout_s: float = 10.0, migrate: bool = True) -> None:
        self.conninfo = conninfo
        self.clock = clock
        self.migrate = migrate
        self._connect_timeout = int(max(1, connect_timeout_s))
        # (connection, when it was last given back)
        self._pool: queue.LifoQueue[tuple[psycopg.Connection[dict[str, Any]], float]] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(pool_size)
        self._closed = False

    # -- connections ---------------------------------------------------------------------------
    def _connect(self) -> psycopg.Connection[dict[str, Any]]:
        return psycopg.connect(self.conninfo, autocommit=True, row_factory=dict_row,
                               connect_timeout=self._connect_timeout)

    def _lend(self) -> psycopg.Connection[dict[str, Any]]:
        """A live connection: a pooled one (checked first if it idled past :data:`_CHECK_IDLE_S`) or a new one."""
        while True:
            try:
                conn, returned = self._pool.get_nowait()
            except queue.Empty:
                return self._connect()
            if conn.closed or conn.broken:
                continue
            if time.monotonic() - returned < _CHECK_IDLE_S:
                return conn
            try:
                conn.execute("SELECT 1")
                return conn
            except psycopg.Error:
                conn.close()  # dead (the server restarted, or dropped it): try the next, then a new one

    @contextmanager
    def _conn(self) -> Iterator[psycopg.Connection[dict[str, Any]]]:
        self._slots.acquire()
        conn = None
        try:
            conn = self._lend()
            yield conn
        except psycopg.OperationalError as e:
            if conn is None or conn.closed or conn.broken:  # not reached, or lost under the call
                raise DatabaseUnavailable() from e
            raise
        finally:  # back to the pool, unless broken (a lost server) or the store is closing
            if conn is not None:
                if self._closed or conn.closed or conn.broken:
                    conn.close()
                else:
                    self._pool.put((conn, time.monotonic()))
            self._slots.release()

    @contextmanager
    def _tx(self) -> Iterator[psycopg.Connection[dict[str, Any]]]:
        with self._conn() as conn, conn.transaction():
            yield conn

    def _p(self, **params: Any) -> dict[str, Any]:
        return {"now": None if self.clock is None else self.clock(), **params}

    def _read(self, sql: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        with self._conn() as conn:
            return conn.execute(sql, self._p(**(params or {}))).fetchall()

    def init(self) -> None:
        """Apply pending migrations (safe with several processes starting at once: they take turns) or, with
        ``migrate`` off, check that the schema is current."""
        if self.migrate:
            upgrade(self.conninfo)
            return
        version = schema_version(self.conninfo)
        _check_not_newer(version)
        if version < LATEST:
            raise StorageError(f"the database schema is at version {version}, this quantd needs {LATEST}: "
                               "run `quantd db upgrade`")

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self._pool.get_nowait()[0].close()
            except queue.Empty:
                return

    def ping(self) -> bool:
        try:
            return bool(self._read("SELECT 1 AS one")[0]["one"] == 1)
        except (psycopg.Error, DatabaseUnavailable):
            return False

    @staticmethod
    def _notify(db: psycopg.Connection[Any], job_id: str) -> None:
        db.execute("SELECT pg_notify(%s, %s)", (CHANNEL, job_id))

    # -- submission and reads ----------------------------------------------------------------
    def insert(self, *, job_id: str, tenant: str, config: dict[str, Any], input: dict[str, Any],
               calibration: dict[str, Any] | None, idempotency_key: str | None, max_attempts: int,
               max_queue: int, retry_after: int,
               before_commit: Callable[[], None], device: str | None = None,
               progress: dict[str, Any] | None = None) -> tuple[JobRecord, bool]:
        """As ``SQLiteJobStore.insert``. Two replicas inserting the same idempotency key at once: the second
        waits for the first's transaction and returns its job."""
        with self._tx() as db:
            if idempotency_key is not None:
                row = db.execute("SELECT * FROM jobs WHERE tenant = %s AND idempotency_key = %s",
                                 (tenant, idempotency_key)).fetchone()
                if row is not None:
                    return JobRecord.from_row(row), False
            depth = db.execute("SELECT COUNT(*) AS n FROM jobs WHERE status = 'queued'").fetchone()
            if depth is not None and depth["n"] >= max_queue:
                raise QueueFull(f"{depth['n']} jobs queued (max_queue {max_queue}); retry later",
                                retry_after=retry_after)
            row = db.execute(
                "INSERT INTO jobs (id, tenant, status, config, input, calibration, max_attempts, created_at,"
                " idempotency_key, device, progress) VALUES (%(id)s, %(tenant)s, 'queued',"
                f" %(config)s, %(input)s, %(calibration)s, %(max_attempts)s, {_NOW}, %(key)s, %(device)s,"
                " %(progress)s)"
                " ON CONFLICT (tenant, idempotency_key) DO NOTHING RETURNING *",
                self._p(id=job_id, tenant=tenant, config=_js(config), input=_js(input),
                        calibration=_js(calibration), max_attempts=max_attempts, key=idempotency_key,
                        device=device, progress=_js(progress or {}))).fetchone()
            if row is None:  # another replica committed the same key meanwhile
                row = db.execute("SELECT * FROM jobs WHERE tenant = %s AND idempotency_key = %s",
                                 (tenant, idempotency_key)).fetchone()
                assert row is not None  # the conflict was on this very row
                return JobRecord.from_row(row), False
            before_commit()
            self._notify(db, job_id)
            return JobRecord.from_row(row), True

    def get(self, job_id: str) -> JobRecord | None:
        rows = self._read("SELECT * FROM jobs WHERE id = %(id)s", {"id": job_id})
        return JobRecord.from_row(rows[0]) if rows else None

    def list_jobs(self, tenant: str, *, status: str | None, limit: int,
                  after: tuple[float, str] | None) -> list[JobRecord]:
        sql, params = "SELECT * FROM jobs WHERE tenant = %(tenant)s", {"tenant": tenant, "limit": limit}
        if status is not None:
            sql += " AND status = %(status)s"
            params["status"] = status
        if after is not None:
            sql += " AND (created_at < %(at)s OR (created_at = %(at)s AND id < %(after_id)s))"
            params["at"], params["after_id"] = after
        sql += " ORDER BY created_at DESC, id DESC LIMIT %(limit)s"
        return [JobRecord.from_row(r) for r in self._read(sql, params)]

    def known_ids(self, ids: list[str]) -> set[str]:
        if not ids:
            return set()
        return {r["id"] for r in self._read("SELECT id FROM jobs WHERE id = ANY(%(ids)s)", {"ids": ids})}

    def queue_depth(self) -> int:
        return int(self._read("SELECT COUNT(*) AS n FROM jobs WHERE status = 'queued'")[0]["n"])

    def counts_by_status(self) -> dict[str, int]:
        counts = dict.fromkeys(STATUSES, 0)
        for row in self._read("SELECT status, COUNT(*) AS n FROM jobs GROUP BY status"):
            counts[row["status"]] = int(row["n"])
        return counts

    def succeeded_input_bytes(self) -> int:
        rows = self._read("SELECT COALESCE(SUM((input::jsonb ->> 'bytes')::bigint), 0) AS n FROM jobs"
                          " WHERE status = 'succeeded'")
        return int(rows[0]["n"])

    # -- the worker side -----------------------------------------------------------------------
    def claim(self, worker_id: str, device: str, lease_s: float) -> JobRecord | None:
        with self._tx() as db:
            row = db.execute(
                f"UPDATE jobs SET status = 'running', attempts = attempts + 1,"
                f" lease_owner = %(worker)s || '#' || (attempts + 1), lease_expires_at = {_NOW} + %(lease)s,"
                f" device = %(device)s, started_at = COALESCE(started_at, {_NOW}), heartbeat_at = {_NOW}"
                " WHERE id = (SELECT id FROM jobs WHERE status = 'queued' ORDER BY created_at, seq LIMIT 1"
                " FOR UPDATE SKIP LOCKED) RETURNING *",
                self._p(worker=worker_id, lease=lease_s, device=device)).fetchone()
            if row is not None:
                self._notify(db, row["id"])
        return None if row is None else JobRecord.from_row(row)

    def heartbeat(self, job_id: str, owner: str, lease_s: float,
                  progress: dict[str, Any] | None) -> LeaseState:
        with self._tx() as db:
            row = db.execute(
                f"UPDATE jobs SET lease_expires_at = {_NOW} + %(lease)s, heartbeat_at = {_NOW},"
                " progress = COALESCE(%(progress)s, progress)"
                " WHERE id = %(id)s AND lease_owner = %(owner)s AND status = 'running' RETURNING cancel_requested",
                self._p(lease=lease_s, progress=_js(progress), id=job_id, owner=owner)).fetchone()
            if row is not None and progress is not None:
                self._notify(db, job_id)
        if row is None:
            return "lost"
        return "cancel" if row["cancel_requested"] else "ok"

    def lease_state(self, job_id: str, owner: str) -> LeaseState:
        rows = self._read("SELECT cancel_requested FROM jobs WHERE id = %(id)s AND lease_owner = %(owner)s"
                          " AND status = 'running'", {"id": job_id, "owner": owner})
        if not rows:
            return "lost"
        return "cancel" if rows[0]["cancel_requested"] else "ok"

    def _finish(self, job_id: str, owner: str, status: str, *, result: dict[str, Any] | None = None,
                error: dict[str, Any] | None = None, extra_where: str = "",
                before_commit: Callable[[], None] | None = None) -> bool:
        with self._tx() as db:
            # The row is locked first: while ``before_commit`` installs the files, no reaper can re-queue it.
            held = db.execute("SELECT id FROM jobs WHERE id = %(id)s AND lease_owner = %(owner)s AND status ="
                              f" 'running'{extra_where} FOR UPDATE", {"id": job_id, "owner": owner}).fetchone()
            if held is None:
                return False
            if before_commit is not None:
                before_commit()
            db.execute(f"UPDATE jobs SET status = %(status)s, result = %(result)s, error = %(error)s,"
                       f" finished_at = {_NOW}, lease_owner = NULL, lease_expires_at = NULL WHERE id = %(id)s",
                       self._p(status=status, result=_js(result), error=_js(error), id=job_id))
            self._notify(db, job_id)
        return True

    def complete(self, job_id: str, owner: str, result: dict[str, Any],
                 before_commit: Callable[[], None] | None = None) -> bool:
        """Late acknowledgement (see ``SQLiteJobStore.complete``): ``before_commit`` runs with the row locked
        and the lease found held."""
        return self._finish(job_id, owner, "succeeded", result=result, extra_where=" AND NOT cancel_requested",
                            before_commit=before_commit)

    def fail(self, job_id: str, owner: str, error: dict[str, Any]) -> bool:
        return self._finish(job_id, owner, "failed", error=error)

    def finish_cancelled(self, job_id: str, owner: str) -> bool:
        return self._finish(job_id, owner, "cancelled")

    def release(self, job_id: str, owner: str) -> bool:
        with self._tx() as db:
            row = db.execute(
                "UPDATE jobs SET status = 'queued', attempts = attempts - 1, lease_owner = NULL,"
                f" lease_expires_at = NULL, device = NULL, progress = {_PROGRESS_RESTART}"
                " WHERE id = %s AND lease_owner = %s AND status = 'running' RETURNING id",
                (job_id, owner)).fetchone()
            if row is not None:
                self._notify(db, job_id)
        return row is not None

    # -- cancellation, recovery, expiry --------------------------------------------------------
    def request_cancel(self, job_id: str) -> JobRecord | None:
        with self._tx() as db:
            db.execute(f"UPDATE jobs SET status = 'cancelled', finished_at = {_NOW}, cancel_requested = true"
                       " WHERE id = %(id)s AND status = 'queued'", self._p(id=job_id))
            db.execute("UPDATE jobs SET cancel_requested = true WHERE id = %(id)s AND status = 'running'",
                       {"id": job_id})
            row = db.execute("SELECT * FROM jobs WHERE id = %s", (job_id,)).fetchone()
            self._notify(db, job_id)
        return None if row is None else JobRecord.from_row(row)

    def reap(self, is_dead: Callable[[str], bool]) -> list[JobRecord]:
        """Running jobs whose lease expired (on the database's clock), or whose owner ``is_dead`` knows to
        be gone: re-queued, or failed after ``max_attempts`` (cancelled when a cancel was asked). Rows
        another process is finishing or reaping right now are skipped, not waited for."""
        ended: list[JobRecord] = []
        with self._tx() as db:
            rows = db.execute(
                f"SELECT id, lease_owner, lease_expires_at < {_NOW} AS expired, attempts, max_attempts,"
                " cancel_requested FROM jobs WHERE status = 'running' FOR UPDATE SKIP LOCKED",
                self._p()).fetchall()
            for r in rows:
                if not r["expired"] and not is_dead(r["lease_owner"]):
                    continue
                if r["cancel_requested"]:
                    status, error = "cancelled", None
                elif r["attempts"] >= r["max_attempts"]:
                    status, error = "failed", worker_lost_error(r["attempts"])
                else:
                    db.execute("UPDATE jobs SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL,"
                               f" device = NULL, progress = {_PROGRESS_RESTART} WHERE id = %s", (r["id"],))
                    self._notify(db, r["id"])
                    continue
                row = db.execute(f"UPDATE jobs SET status = %(status)s, error = %(error)s, finished_at = {_NOW},"
                                 " lease_owner = NULL, lease_expires_at = NULL WHERE id = %(id)s RETURNING *",
                                 self._p(status=status, error=_js(error), id=r["id"])).fetchone()
                self._notify(db, r["id"])
                if row is not None:
                    ended.append(JobRecord.from_row(row))
        return ended

    def expire_due(self, ttl_s: float) -> list[str]:
        rows = self._read("SELECT id FROM jobs WHERE status IN ('succeeded','failed','cancelled')"
                          f" AND expired_at IS NULL AND finished_at < {_NOW} - %(ttl)s", {"ttl": ttl_s})
        return [r["id"] for r in rows]

    def mark_expired(self, job_id: str) -> None:
        with self._tx() as db:
            db.execute(f"UPDATE jobs SET expired_at = {_NOW} WHERE id = %(id)s AND expired_at IS NULL",
                       self._p(id=job_id))

    # -- worker registry -----------------------------------------------------------------------
    def register_worker(self, worker_id: str, device: str) -> None:
        with self._tx() as db:
            db.execute(f"INSERT INTO workers (id, device, started_at, heartbeat_at) VALUES (%(id)s, %(device)s,"
                       f" {_NOW}, {_NOW}) ON CONFLICT (id) DO UPDATE SET device = EXCLUDED.device,"
                       " started_at = EXCLUDED.started_at, heartbeat_at = EXCLUDED.heartbeat_at, busy_job = NULL",
                       self._p(id=worker_id, device=device))

    def worker_heartbeat(self, worker_id: str, busy_job: str | None) -> None:
        with self._tx() as db:
            db.execute(f"UPDATE workers SET heartbeat_at = {_NOW}, busy_job = %(busy)s WHERE id = %(id)s",
                       self._p(busy=busy_job, id=worker_id))

    def unregister_worker(self, worker_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM workers WHERE id = %s", (worker_id,))

    def live_workers(self, within_s: float) -> list[dict[str, Any]]:
        return self._read(f"SELECT id, device, started_at, heartbeat_at, busy_job FROM workers"
                          f" WHERE heartbeat_at >= {_NOW} - %(within)s", {"within": within_s})

    def prune_workers(self, older_than_s: float) -> int:
        with self._tx() as db:
            cur = db.execute(f"DELETE FROM workers WHERE heartbeat_at < {_NOW} - %(age)s",
                             self._p(age=older_than_s))
            return cur.rowcount


class JobListener:
    """``LISTEN quantd_jobs`` on a connection of its own, in a thread: ``on_change(job_id)`` for every change
    any process commits, so that event streams wake at once instead of at their next poll. Reconnects after
    a lost connection; the streams' polling covers the gap."""

    def __init__(self, conninfo: str, on_change: Callable[[str], None]) -> None:
        self.conninfo, self.on_change = conninfo, on_change
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="quantd-pg-listen", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True, connect_timeout=10) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=0.5, stop_after=256):
                            self.on_change(note.payload)
            except psycopg.Error:
                log.warning("job notifications: connection lost; reconnecting", exc_info=True)
                self._stop.wait(1.0)
