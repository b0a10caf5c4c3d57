"""Quantizing a job's model while its upload is still streaming in.

A safetensors file lists its tensors in its header and stores their bytes one after the other, so a
tensor can be quantized as soon as its bytes have landed on disk: by the time the upload is complete
most of the work is done, and the upload, not the quantization, sets the job's latency.

The HTTP layer asks :meth:`PreparedRuns.start` for a run when the ``file`` part of a submit begins (the
``config`` part already received), feeds it the upload's progress (``advance``/``complete``) and hands
it to ``JobService.submit``, which files it under the new job's id before the job row commits. The
worker that claims the job adopts the run (:meth:`PreparedRun.adopt`): it waits for the rest, forwarding
progress and cancellation, and stores the run's artifact as if it had written it itself.

Nothing about durability changes: the upload and the job row are committed exactly as without a run;
a run is an in-memory shortcut of this process. If the process dies, the run is gone and a worker
quantizes the stored upload as usual. A run that cannot be used (another format, a failure, a calibration
file that came with the job, a job claimed elsewhere) is discarded and the job quantized from scratch,
so the outcome, errors included, is always what the worker's own pipeline gives. A run holds the place of
an idle worker: while it computes, that worker claims no other job (:meth:`PreparedRuns.computing`), so
the two never share a device. Its report's ``device`` is where it computed, and its ``elapsed_s`` counts
from the upload's first bytes (the quantization overlapped the rest of the upload).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from quantd.errors import JobCancelled, QuantdError
from quantd_client import Progress, QuantConfig, Report

log = logging.getLogger("quantd.jobs")

# A run holds its worker's place while its upload moves (or has ended); an upload stalled this long
# gives the place back, so that a client that stops sending cannot keep a worker from other jobs.
STALL_S = 10.0

# A finished run that no worker of this process adopted within this time (its job claimed by a worker
# of another process, say) is dropped with its artifact.
UNCLAIMED_MAX_AGE_S = 600.0


class NotStreamable(Exception):
    """The upload is not a format that can be quantized while it streams (only safetensors can)."""


class PreparedRun:
    """One quantization reading an upload as it grows. The upload's writer calls ``advance``,
    ``complete`` or ``abort``; the job's worker calls ``adopt``; anyone may ``cancel``."""

    def __init__(self, upload: Path, artifact: Path, config: QuantConfig, *, device: str, size_bound: int) -> None:
        self.upload, self.artifact, self.config, self.device = upload, artifact, config, device
        self.size_bound = size_bound
        self.report: Report | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.finished_at: float | None = None
        from quantd.io.growing import GrowingFile  # quantd.io imports torch: not at the API's import time

        self._source = GrowingFile(upload)
        self._cancelled = False
        self._lock = threading.Lock()
        self._sink: Callable[[Progress], None] | None = None
        self._should_cancel: Callable[[], bool] | None = None
        self._last: Progress | None = None
        self._began = False  # a thread has taken the run up
        self.on_done: Callable[[], None] = lambda: None

    def holds_worker(self, now: float) -> bool:
        """Computing, or about to (its upload still moving or complete): a worker of its device waits."""
        src = self._source
        return not self.done.is_set() and (src.completed or now - src.last_advance < STALL_S)

    def start(self, pool: _Threads | None = None) -> None:
        """Run on ``pool`` (long-lived threads keep their memory arenas warm), else on a new thread."""
        if pool is not None:
            pool.submit(self._run)
        else:
            threading.Thread(target=self._run, name="quantd-prepared", daemon=True).start()

    # -- the upload's side ---------------------------------------------------------------------
    def advance(self, nbytes: int) -> None:
        self._source.advance(nbytes)

    def complete(self) -> None:
        self._source.complete()

    def abort(self) -> None:
        self.cancel()

    def cancel(self) -> None:
        """Stop the run at its next tensor (or its next wait for upload bytes); its artifact is deleted."""
        self._cancelled = True
        self._source.abort()
        if self.done.is_set():  # finished already: nobody will take its artifact
            self.artifact.unlink(missing_ok=True)

    # -- the run ---------------------------------------------------------------------------------
    def _progress(self, progress: Progress) -> None:
        with self._lock:  # held while forwarding, so that adopt() can never send an older one after it
            self._last = progress
            if self._sink is not None:
                self._sink(progress)

    def _stop_asked(self) -> bool:
        return self._cancelled or (self._should_cancel is not None and self._should_cancel())

    def _run(self) -> None:
        from quantd.io.formats import is_safetensors_head
        from quantd.io.growing import UploadAborted
        from quantd.io.pipeline import quantize_model
        from quantd.io.readers import SafetensorsReader

        with self._lock:
            self._began = True
        try:
            if self._cancelled:
                raise JobCancelled("cancelled before it started")
            if not is_safetensors_head(self._source.read(16)):
                raise NotStreamable("not a safetensors upload")
            with SafetensorsReader(self.upload, self._source, size_bound=self.size_bound) as reader:
                self.report = quantize_model(reader, self.artifact, self.config, device=self.device,
                                             input_bytes=self._source.final_size, on_progress=self._progress,
                                             should_cancel=self._stop_asked)
        except BaseException as e:
            self.error = e
            self.artifact.unlink(missing_ok=True)
            if not isinstance(e, (NotStreamable, UploadAborted, JobCancelled, QuantdError)):
                log.warning("quantization during upload failed; the job's worker will redo it", exc_info=True)
        finally:
            self._source.close()
            self.finished_at = time.monotonic()
            self.done.set()
            if self._cancelled:  # cancelled while it finished: cancel() may have looked before done was set
                self.artifact.unlink(missing_ok=True)
            self.on_done()

    # -- the worker's side -------------------------------------------------------------------------
    def adopt(self, on_progress: Callable[[Progress], None], should_cancel: Callable[[], bool]) -> Report | None:
        """Wait for the run, forwarding its progress to ``on_progress`` and polling ``should_cancel``
        between tensors. Returns its Report (the artifact is at ``self.artifact``), or None when it cannot
        be used and the caller must quantize on its own (its artifact is gone then). Raises JobCancelled
        when ``should_cancel`` ended it. A run no thread has taken up yet is cancelled, not waited for."""
        with self._lock:
            if not self._began:
                self._cancelled = True
            else:
                self._sink, self._should_cancel = on_progress, should_cancel
                if self._last is not None:
                    on_progress(self._last)
        if self._cancelled:
            self.cancel()
            return None
        while not self.done.wait(0.5):  # the run also polls should_cancel, but only between tensors
            if should_cancel():
                self._should_cancel = lambda: True
                self._source.abort()  # a read waiting for bytes ends too
        if self.report is not None and not self._cancelled:
            return self.report
        self.artifact.unlink(missing_ok=True)
        if isinstance(self.error, JobCancelled) and not self._cancelled:
            raise self.error
        return None


class _Threads:
    """A few daemon threads taking callables from a queue (daemon: a run waiting on an upload that will
    never end cannot hold up the interpreter's exit, as ``ThreadPoolExecutor``'s threads would)."""

    def __init__(self, count: int) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._loop, name=f"quantd-prepared-{i}", daemon=True)
                         for i in range(max(1, count))]
        for t in self._threads:
            t.start()

    def _loop(self) -> None:
        while (fn := self._queue.get()) is not None:
            fn()  # PreparedRun._run catches everything itself

    def submit(self, fn: Callable[[], None]) -> None:
        self._queue.put(fn)

    def shutdown(self, timeout: float = 30.0) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout)


class PreparedRuns:
    """The runs of this process: started by uploads, filed under their job's id, popped by workers.

    ``capacity()`` is how many runs may compute at once (the idle local workers: a run is the work one of
    them would do a moment later); ``device()`` is where a new run computes."""

    def __init__(self, *, new_artifact_path: Callable[[], Path], capacity: Callable[[], int],
                 device: Callable[[], str], threads: int = 1, on_done: Callable[[], None] = lambda: None) -> None:
        self._new_artifact_path, self._capacity, self._device = new_artifact_path, capacity, device
        self._on_done = on_done  # a run ended: the worker whose place it held may claim again
        # capacity() never exceeds the embedded workers: one thread each, reused from run to run.
        self._threads = _Threads(threads)
        self._closed = False
        self._lock = threading.Lock()
        self._unfiled: set[PreparedRun] = set()
        self._filed: dict[str, PreparedRun] = {}
        self.started = self.adopted = 0

    def _running(self) -> list[PreparedRun]:
        return [r for r in (*self._unfiled, *self._filed.values()) if not r.done.is_set()]

    def computing(self, device: str) -> int:
        """Runs computing on ``device`` now, each holding the place of an idle worker of that device
        (:meth:`PreparedRun.holds_worker`)."""
        now = time.monotonic()
        with self._lock:
            return sum(r.device == device and r.holds_worker(now) for r in self._running())

    def start(self, upload: Path, config: QuantConfig, *, size_bound: int) -> PreparedRun | None:
        """A run over the upload being written at ``upload``, or None when no worker is free for one."""
        with self._lock:
            if self._closed or len(self._running()) >= self._capacity():
                return None
            run = PreparedRun(upload, self._new_artifact_path(), config, device=self._device(),
                              size_bound=size_bound)
            run.on_done = self._on_done
            self._unfiled.add(run)
            self.started += 1
        run.start(self._threads)
        return run

    def close(self) -> None:
        """Cancel every run and stop the threads (the service is stopping, its workers stopped first)."""
        with self._lock:
            self._closed = True
            runs = [*self._unfiled, *self._filed.values()]
            self._unfiled.clear()
            self._filed.clear()
        for run in runs:
            run.cancel()
        self._threads.shutdown()

    def file(self, job_id: str, run: PreparedRun) -> None:
        """``run`` belongs to job ``job_id`` (call before the job can be claimed)."""
        with self._lock:
            self._unfiled.discard(run)
            self._filed[job_id] = run

    def discard(self, run: PreparedRun, job_id: str | None = None) -> None:
        """Cancel ``run`` and forget it (the upload failed, or its job will not use it)."""
        with self._lock:
            self._unfiled.discard(run)
            if job_id is not None and self._filed.get(job_id) is run:
                del self._filed[job_id]
        run.cancel()

    def pop(self, job_id: str) -> PreparedRun | None:
        """The run filed under ``job_id``, taken (a worker is about to adopt it)."""
        with self._lock:
            return self._filed.pop(job_id, None)

    def adopted_one(self) -> None:
        """A worker stored a run's artifact as its job's (counted for tests and metrics)."""
        with self._lock:
            self.adopted += 1

    def expire(self, max_age_s: float = UNCLAIMED_MAX_AGE_S) -> int:
        """Drop finished runs no worker of this process took within ``max_age_s`` (their job was claimed by
        another process's worker, say), with their artifacts; called by the reaper. Returns how many."""
        now = time.monotonic()
        with self._lock:
            stale = [(job_id, run) for job_id, run in self._filed.items()
                     if run.finished_at is not None and now - run.finished_at > max_age_s]
            for job_id, _ in stale:
                del self._filed[job_id]
        for _, run in stale:
            run.cancel()
        return len(stale)
