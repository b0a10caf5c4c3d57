"""A pool of worker threads plus the reaper (stale leases, TTL expiry, leftovers), and ``run_worker``,
the standalone worker process of ``quantd worker``."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType

from .config import JobsConfig, worker_devices
from .prepared import PreparedRuns
from .references import References
from .storage import ArtifactStore
from .store import JobStore
from .worker import QuantizeFn, Worker, default_quantize_fn, owner_is_dead

log = logging.getLogger("quantd.jobs")

TMP_MAX_AGE_S = 24 * 3600.0  # uploads never submitted, parts left by dead workers
ORPHAN_UPLOAD_AGE_S = 3600.0  # uploads moved in place by a submit whose transaction did not commit


def open_backends(config: JobsConfig) -> tuple[JobStore, ArtifactStore]:
    """The backends the config's URLs name: SQLite at ``data_dir/quantd.db`` and files under ``data_dir``
    by default (see :mod:`quantd.jobs.backends`)."""
    from .backends import open_backends as open_by_url

    return open_by_url(config)


def sweep(config: JobsConfig, store: JobStore, storage: ArtifactStore) -> None:
    """One pass of the reaper: re-queue or end stale jobs, expire old files, drop leftovers."""
    for job in store.reap(owner_is_dead):
        log.warning("job %s ended by the reaper: %s", job.id, job.status)
        storage.delete_job_files(job.id)
    for job_id in store.expire_due(config.ttl_s):
        storage.delete_job_files(job_id)
        store.mark_expired(job_id)
    storage.sweep_tmp(TMP_MAX_AGE_S)
    store.prune_workers(TMP_MAX_AGE_S)
    candidates = storage.list_upload_ids(ORPHAN_UPLOAD_AGE_S)
    known = store.known_ids(candidates)
    for job_id in candidates:
        if job_id not in known:
            storage.delete_job_files(job_id)


class WorkerPool:
    """Embedded workers (one per device by default) and the periodic reaper."""

    def __init__(self, config: JobsConfig, store: JobStore, storage: ArtifactStore,
                 quantize_fn: QuantizeFn | None = None, *, workers: bool = True,
                 on_change: Callable[[str], None] | None = None, prepared: PreparedRuns | None = None) -> None:
        self.config, self.store, self.storage = config, store, storage
        self.stop_event = threading.Event()
        self.wake = threading.Event()
        self.workers: list[Worker] = []
        if workers:
            fn = quantize_fn or default_quantize_fn()
            references = References.for_storage(storage, config.s3_endpoint_url)
            self.workers = [
                Worker(i, device, store=store, storage=storage, quantize_fn=fn, lease_s=config.lease_s,
                       heartbeat_s=config.heartbeat_s, poll_s=config.poll_s,
                       progress_write_s=config.progress_write_s, wake=self.wake, stop=self.stop_event,
                       on_change=on_change, prepared=prepared, references=references)
                for i, device in enumerate(worker_devices(config))
            ]
        self.prepared = prepared
        self.draining = False
        for w in self.workers:
            w.may_claim = self._may_claim
        self._reaper = threading.Thread(target=self._reap_loop, name="quantd-reaper", daemon=True)

    def drain(self) -> None:
        """Claim no more jobs (the process is stopping): running ones go on until :meth:`stop`."""
        self.draining = True

    def _may_claim(self, worker: Worker) -> bool:
        """Not once the process is stopping, nor while runs during uploads take every idle worker's place on
        its device (they would share it)."""
        if self.draining:
            return False
        if self.prepared is None:
            return True
        idle = sum(w.device == worker.device for w in self._idle_workers())
        return self.prepared.computing(worker.device) < idle

    def start(self) -> None:
        sweep(self.config, self.store, self.storage)  # jobs left running by a previous life, first
        for w in self.workers:
            w.start()
        self._reaper.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Workers stop claiming; a running job is interrupted at its next tensor and given back
        to the queue (its attempt not counted)."""
        self.stop_event.set()
        self.wake.set()
        for w in self.workers:
            w.join(timeout)
        if self._reaper.is_alive():
            self._reaper.join(timeout)

    def _reap_loop(self) -> None:
        while not self.stop_event.wait(self.config.reap_interval_s):
            try:
                sweep(self.config, self.store, self.storage)
                if self.prepared is not None:
                    self.prepared.expire()
            except Exception:
                log.exception("reaper pass failed")

    def alive(self) -> int:
        return sum(w.alive for w in self.workers)

    def busy(self) -> int:
        return sum(w.busy_job is not None for w in self.workers)

    def _idle_workers(self) -> list[Worker]:
        return [w for w in self.workers if w.alive and w.busy_job is None]

    def idle(self) -> int:
        return len(self._idle_workers())

    def idle_device(self) -> str:
        """The device of an idle worker (of the first worker when none is idle)."""
        idle = self._idle_workers()
        return (idle[0] if idle else self.workers[0]).device


def run_worker(config: JobsConfig, *, quantize_fn: QuantizeFn | None = None,
               stop: threading.Event | None = None) -> None:
    """A worker process over the data dir shared with the API (``quantd worker``): runs until
    SIGTERM/SIGINT (or ``stop`` is set), then stops gracefully."""
    store, storage = open_backends(config)
    pool = WorkerPool(config, store, storage, quantize_fn)
    done = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        def _on_signal(signum: int, frame: FrameType | None) -> None:
            log.info("signal %d: stopping workers", signum)
            done.set()

        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)
    pool.start()
    log.info("quantd worker: %d worker(s) on %s over %s", len(pool.workers),
             [w.device for w in pool.workers], config.data_dir)
    try:
        while not done.wait(1.0):
            if pool.alive() == 0:
                log.error("all workers died; exiting")
                break
    finally:
        pool.stop()
        store.close()
