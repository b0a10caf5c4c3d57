"""Workers: threads that claim jobs, run the quantization pipeline under a lease, and record the end.

Crash policy:
- ``torch.cuda.OutOfMemoryError`` → the CUDA cache is emptied and the job fails with
  ``urn:quantd:out-of-memory`` (no retry on CPU: a model that does not fit would only be slow there;
  the user can resubmit with a CPU server or a smaller model).
- a ``quantd.errors.QuantdError`` → the job fails with its type/title/detail (deterministic: no retry).
- any other exception → logged with its traceback, the job fails with ``urn:quantd:internal``;
  the worker keeps running.
- the worker process dying → its lease expires (or its owner is seen dead) and the reaper re-queues the
  job, failing it after ``max_attempts`` with "worker lost N times". A job is never lost.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from quantd.errors import JobCancelled, QuantdError
from quantd_client import Progress, QuantConfig, Report

from . import scratch
from .errors import DatabaseUnavailable
from .prepared import PreparedRun, PreparedRuns
from .records import JobRecord
from .references import References, destination_key
from .storage import ArtifactStore
from .store import JobStore

log = logging.getLogger("quantd.jobs")


def host_identity() -> str:
    """This host's name and, on Linux, the inode of our PID namespace: the pids of lease owners with this
    identity are ours to look up. Two containers can share a hostname (``network_mode: host``, a pod) but
    not a PID namespace, and another's pid that is not running here may be a live worker there."""
    name = socket.gethostname().replace("/", "_")
    try:
        return f"{name}@{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # no /proc (not Linux): the hostname alone
        return name


HOST = host_identity()
BOOT = uuid.uuid4().hex[:12]  # this process's identity: a restarted process with the same pid differs


class QuantizeFn(Protocol):
    def __call__(self, src: Path, dst: Path, config: QuantConfig, *, device: str, filename: str | None,
                 job_id: str | None, on_progress: Callable[[Progress], None] | None,
                 should_cancel: Callable[[], bool] | None) -> Report: ...


def default_quantize_fn() -> QuantizeFn:
    from quantd.io.pipeline import quantize_file

    fn: QuantizeFn = quantize_file
    return fn


def directory_output(input_info: dict[str, Any], config: dict[str, Any]) -> bool:
    """Whether a job's output is a directory (its artifact then a tar): a model directory's, or one file's
    in a format that writes ``config.json`` beside its weights."""
    if input_info.get("files") is not None:
        return True
    from quantd.io.outputs import get_format

    return get_format(str(config.get("output", "safetensors"))).writes_config


def _input_hashes(src: Path) -> dict[str, Any]:
    """A job by reference's source as read (a file, or a directory of them): its sha256, and each file's,
    digested as an uploaded directory's (the sorted ``path sha256`` lines), for its record's ``input``."""
    from quantd.io.files import sha256_file
    from quantd.io.model_dir import directory_digest

    if not src.is_dir():
        return {"input_sha256": sha256_file(src)}
    files = {p.relative_to(src).as_posix(): sha256_file(p) for p in sorted(src.rglob("*")) if p.is_file()}
    return {"input_sha256": directory_digest(files), "input_files_sha256": files}


def _remove(path: Path) -> None:
    """A scratch file or directory of this attempt, gone."""
    import shutil

    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def new_worker_id(index: int) -> str:
    return f"{HOST}/{os.getpid()}/{BOOT}/w{index}"


def owner_is_dead(owner: str | None) -> bool:
    """True when a lease owner (``host/pid/boot/wN#attempt``) is a process on this host that is gone:
    its pid is not running, or the pid is ours but from an earlier boot. Unknown hosts (another
    :func:`host_identity`: another hostname or PID namespace): False (their leases expire instead)."""
    if not owner:
        return True
    parts = owner.split("/")
    if len(parts) != 4 or parts[0] != HOST or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    if pid == os.getpid():
        return parts[2] != BOOT
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _error(type_: str, title: str, detail: str) -> dict[str, str]:
    return {"type": type_, "title": title, "detail": detail}


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` that runs to its end at most once; later calls do nothing."""
    done = False

    def call() -> None:
        nonlocal done
        if not done:
            fn()
            done = True

    return call


def redact_paths(message: str, private: Sequence[Path]) -> str:
    """``message`` with every path under ``private`` (the data dir, its scratch) replaced by ``<server path>``."""
    roots = {str(p) for root in private for p in (Path(root), Path(root).resolve())}
    for root in sorted(roots, key=len, reverse=True):  # the longest first: one root may hold another
        if root not in ("", "/", "."):
            message = re.sub(re.escape(root) + r"[^\s'\"]*", "<server path>", message)
    return message


def describe_failure(e: BaseException, private: Sequence[Path] = ()) -> str:
    """``Type: message`` of an unexpected exception for a job's error, without the server's paths: an
    OSError's file names are left out (``[Errno 36] File name too long``), and any path under ``private``
    in another message is redacted (:func:`redact_paths`)."""
    if isinstance(e, OSError) and e.strerror:
        message = f"[Errno {e.errno}] {e.strerror}" if e.errno is not None else e.strerror
    else:
        message = redact_paths(str(e), private)
    return f"{type(e).__name__}: {message}" if message else type(e).__name__


class _Lease:
    """Keeps one claimed job's lease alive from a side thread; throttles progress writes;
    answers ``should_cancel`` (a user cancel, a lost lease, or a shutdown)."""

    def __init__(self, store: JobStore, job: JobRecord, *, lease_s: float, heartbeat_s: float,
                 progress_write_s: float, shutdown: threading.Event, on_beat: Callable[[], None],
                 on_write: Callable[[], None] | None = None) -> None:
        self.store, self.job_id, self.owner = store, job.id, job.lease_owner or ""
        self.on_beat = on_beat
        self.on_write = on_write or (lambda: None)
        self.lease_s, self.heartbeat_s, self.progress_write_s = lease_s, heartbeat_s, progress_write_s
        self.shutdown = shutdown
        self.state = "ok"
        self._progress: dict[str, Any] | None = None
        self._last_write = 0.0
        self._last_check = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"quantd-lease-{job.id[:8]}", daemon=True)

    def __enter__(self) -> _Lease:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._done.wait(self.heartbeat_s):
            try:
                self._update(self.store.heartbeat(self.job_id, self.owner, self.lease_s, self._progress))
                self.on_beat()
            except Exception:  # a missed beat is survivable: the lease outlasts several
                log.exception("job %s: heartbeat failed", self.job_id)

    def _update(self, state: str) -> None:
        if state != "ok":
            self.state = state

    def on_progress(self, progress: Progress) -> None:
        self._progress = progress.model_dump()
        now = time.monotonic()
        final = progress.tensors_total > 0 and progress.tensors_done >= progress.tensors_total
        if final or now - self._last_write >= self.progress_write_s:
            self._last_write = now
            try:
                self._update(self.store.heartbeat(self.job_id, self.owner, self.lease_s, self._progress))
            except Exception:  # the database briefly away: the job goes on; the beat thread renews the lease
                log.warning("job %s: progress not recorded", self.job_id, exc_info=True)
                return
            self.on_write()

    def should_cancel(self) -> bool:
        now = time.monotonic()
        if self.state == "ok" and now - self._last_check >= self.progress_write_s:
            self._last_check = now
            try:
                self._update(self.store.lease_state(self.job_id, self.owner))
            except Exception:  # unknown for now: asked again at the next check
                log.warning("job %s: lease not checked", self.job_id, exc_info=True)
        return self.state != "ok" or self.shutdown.is_set()


class Worker:
    """One worker thread bound to one device."""

    def __init__(self, index: int, device: str, *, store: JobStore, storage: ArtifactStore,
                 quantize_fn: QuantizeFn, lease_s: float, heartbeat_s: float, poll_s: float,
                 progress_write_s: float, wake: threading.Event, stop: threading.Event,
                 on_change: Callable[[str], None] | None = None, prepared: PreparedRuns | None = None,
                 references: References | None = None) -> None:
        self.id = new_worker_id(index)
        self.prepared = prepared
        self.may_claim: Callable[[Worker], bool] = lambda worker: True  # set by the pool
        self.on_change = on_change or (lambda job_id: None)
        self.device = device
        self.store, self.storage, self.quantize_fn = store, storage, quantize_fn
        self.lease_s, self.heartbeat_s, self.poll_s = lease_s, heartbeat_s, poll_s
        self.progress_write_s = progress_write_s
        self.wake, self.stop = wake, stop
        self.busy_job: str | None = None
        self._output_files: dict[str, list[dict[str, Any]]] = {}  # a directory job's output, until recorded
        self._input_hashes: dict[str, dict[str, Any]] = {}  # a job by reference's source, hashed once read
        self.references = references or References()
        self._thread = threading.Thread(target=self._loop, name=f"quantd-worker-{index}", daemon=True)

    def start(self) -> None:
        self.store.register_worker(self.id, self.device)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        last_beat = 0.0
        while not self.stop.is_set():
            try:
                if time.monotonic() - last_beat >= self.heartbeat_s:
                    self.store.worker_heartbeat(self.id, None)
                    last_beat = time.monotonic()
                job = self.store.claim(self.id, self.device, self.lease_s) if self.may_claim(self) else None
            except Exception:  # the DB briefly unavailable must not kill the worker
                log.exception("worker %s: claim failed", self.id)
                job = None
            if job is None:
                self.wake.wait(self.poll_s)
                self.wake.clear()
                continue
            self.busy_job = job.id
            try:
                self.store.worker_heartbeat(self.id, job.id)
                self.run_job(job)
            except Exception:
                # Recording the end failed (DB or disk): the lease expires and the reaper retries it.
                log.exception("worker %s: job %s could not be recorded", self.id, job.id)
            finally:
                self.busy_job = None
                last_beat = 0.0
        try:
            self.store.unregister_worker(self.id)
        except Exception:
            log.exception("worker %s: unregister failed", self.id)

    def run_job(self, job: JobRecord) -> None:
        owner = job.lease_owner or ""
        log.info("worker %s: job %s attempt %d on %s", self.id, job.id, job.attempts, self.device)
        tmp = self.storage.artifact_tmp_path(job.id)
        try:
            with _Lease(self.store, job, lease_s=self.lease_s, heartbeat_s=self.heartbeat_s,
                        progress_write_s=self.progress_write_s, shutdown=self.stop,
                        on_beat=lambda: self.store.worker_heartbeat(self.id, job.id),
                        on_write=lambda: self.on_change(job.id)) as lease:
                outcome = self._quantize(job, tmp, lease)
            if not isinstance(outcome, Report):
                tmp.unlink(missing_ok=True)  # no partial artifact outlives the job's end
            if isinstance(outcome, dict):
                self._record(self.store.fail, job.id, owner, outcome)  # its upload stays until the TTL sweep
                return
            if outcome is None:  # cancelled, lease lost, or shutting down
                self._end_interrupted(job, owner)
                return
            sha256, size = self.storage.seal_artifact(tmp)
            report = outcome.model_copy(update={"job_id": job.id})
            try:
                report_json = report.model_dump_json()
            except ValueError as e:  # not a passing fault: re-running the job would give the same report
                log.exception("worker %s: job %s: the report cannot be written", self.id, job.id)
                self._record(self.store.fail, job.id, owner, _error(
                    "urn:quantd:internal", "Internal error", f"the report cannot be written ({type(e).__name__})"))
                return
            report_tmp = self.storage.stage_report(job.id, report_json)
            result = {"artifact_bytes": size, "artifact_sha256": sha256,
                      "summary": report.summary.model_dump(mode="json")}
            files = self._output_files.pop(job.id, None)
            if files is not None:  # a directory output: the artifact is its tar
                result["files"] = files
            result.update(self._input_hashes.pop(job.id, {}))

            @_once  # a retry of complete() after a commit that failed finds the files already moved
            def install() -> None:  # only while the lease is held (store.complete): the files are the job's
                destination = job.input.get("destination")
                if destination is not None and files is not None:  # every file under the prefix
                    self.references.put_tree(tmp, destination)
                elif destination is not None:
                    from quantd.io.outputs import artifact_suffix

                    suffix = artifact_suffix(str(job.config.get("output", "safetensors")))
                    self.references.put(tmp, destination_key(destination, str(job.input.get("source", "")), suffix))
                self.storage.install_artifact(tmp, job.id)
                self.storage.install_report(report_tmp, job.id)

            try:
                done = self._record(self.store.complete, job.id, owner, result, before_commit=install)
            except OSError as e:  # this host's storage refused the result (full, read-only): the job says why
                log.exception("worker %s: job %s: the result could not be stored", self.id, job.id)
                done = self._record(self.store.fail, job.id, owner, _error(
                    "urn:quantd:storage-error", "Storage error",
                    f"the result could not be stored: {describe_failure(e, self._private_dirs())}"))
            finally:
                report_tmp.unlink(missing_ok=True)
            if not done:
                self._end_interrupted(job, owner)
        finally:
            tmp.unlink(missing_ok=True)
            self._output_files.pop(job.id, None)
            self._input_hashes.pop(job.id, None)
            self.on_change(job.id)  # its end (or release) is in the database: wake the streams

    def _quantize(self, job: JobRecord, tmp: Path, lease: _Lease) -> Report | dict[str, str] | None:
        """The pipeline's Report; an error dict when the job fails; None when interrupted."""
        staged: list[Path] = []  # the file store's local copies of the job's files, given back at the end
        fetched: list[Path] = []  # a job by reference: its source, downloaded to scratch
        try:
            source = job.input.get("source")
            src: Path | None
            if source is not None:  # a job by reference: its object(s), as they were when the job was accepted
                src = self.storage.new_tmp_path(prefix="source")
                try:
                    if source.endswith("/"):  # a directory: each listed object at its checked relative path
                        self._stage_directory(source, dict(job.input.get("source_etags") or {}), src)
                    else:
                        self.references.stage(source, job.input.get("etag", ""), src)
                    self._input_hashes[job.id] = _input_hashes(src)
                except Exception as e:
                    _remove(src)
                    return _error("urn:quantd:source-invalid", "Source cannot be read",
                                  f"source {source!r} could not be read (changed or deleted since the job was "
                                  f"accepted?): {describe_failure(e, self._private_dirs())}")
                fetched.append(src)
            else:
                src = self.storage.stage_upload(job.id, "input")
                if src is None:
                    return _error("urn:quantd:storage-error", "Storage error",
                                  f"the upload of job {job.id} is gone")
                staged.append(src)
            extra: dict[str, Any] = {}
            if job.calibration is not None:
                calibration = self.storage.stage_upload(job.id, "calibration")
                if calibration is None:
                    return _error("urn:quantd:storage-error", "Storage error",
                                  f"the calibration file of job {job.id} is gone")
                staged.append(calibration)
                extra["calibration"] = calibration
            return self._run_pipeline(job, src, tmp, lease, extra)
        finally:
            for path in staged:
                self.storage.unstage(path)
            for path in fetched:
                _remove(path)

    def _private_dirs(self) -> list[Path]:
        """The server's own directories, never shown in a job's error: the data dir (or the local scratch
        of an object store), found from where its scratch paths go."""
        try:
            tmp = self.storage.tmp  # data_dir/tmp/p-<id> (data_dir/tmp where there is no flock)
            return [tmp.parent.parent if scratch.is_process_entry(tmp) else tmp.parent]
        except Exception:  # a storage that cannot say: OSError file names are still left out
            return []

    def _stage_directory(self, source: str, etags: dict[str, str], dst: Path) -> None:
        """A directory source's objects downloaded under ``dst``, each conditional on its accepted ETag."""
        from quantd.io.model_dir import check_relpath

        dst.mkdir()
        for rel, etag in sorted(etags.items()):
            target = dst / check_relpath(rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            self.references.stage(source + rel, etag, target)

    def _run_pipeline(self, job: JobRecord, src: Path, tmp: Path, lease: _Lease,
                      extra: dict[str, Any]) -> Report | dict[str, str] | None:
        import torch

        run = self.prepared.pop(job.id) if self.prepared is not None else None
        try:
            if directory_output(job.input, job.config):
                if run is not None:
                    run.cancel()
                return self._quantize_directory(job, src, tmp, lease, extra.get("calibration"))
            if run is not None:  # quantized while its upload streamed in: the rest, then its artifact
                report = self._adopt(job, run, tmp, lease)
                if report is not None:
                    return report
            return self.quantize_fn(src, tmp, QuantConfig.model_validate(job.config), device=self.device,
                                    filename=job.input.get("filename"), job_id=job.id,
                                    on_progress=lease.on_progress, should_cancel=lease.should_cancel, **extra)
        except JobCancelled:
            return None
        except torch.cuda.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            log.warning("worker %s: job %s out of memory on %s", self.id, job.id, self.device)
            return _error("urn:quantd:out-of-memory", "Out of device memory",
                          f"out of memory on {self.device}: {str(e).splitlines()[0] if str(e) else ''}")
        except QuantdError as e:
            return _error(e.type_, e.title, redact_paths(e.detail, self._private_dirs()))
        except Exception as e:
            log.exception("worker %s: job %s crashed", self.id, job.id)
            return _error("urn:quantd:internal", "Internal error", describe_failure(e, self._private_dirs()))

    def _quantize_directory(self, job: JobRecord, src: Path, tmp: Path, lease: _Lease,
                            calibration: Path | None = None) -> Report:
        """A model directory job (or a one-file job whose format writes a directory): the stored tar (or
        file) unpacked under ``tmp/``, quantized into a directory there, packed as the tar ``tmp``."""
        import shutil

        from quantd.io.model_dir import (
            ModelFiles,
            iter_output_files,
            pack_tar,
            quantize_directory,
            unpack_tar,
        )

        work = self.storage.new_tmp_path(prefix="dirjob")
        work.mkdir()
        try:
            if src.is_dir():  # a directory source, staged file by file
                files = ModelFiles.from_dir(src)
            elif job.input.get("files") is not None:
                files = unpack_tar(src, work / "in")
            else:  # one weight file, named as transformers looks for it
                name = "pytorch_model.bin" if job.input.get("format") == "pytorch" else "model.safetensors"
                files = ModelFiles({name: src})
            report = quantize_directory(files, work / "out", QuantConfig.model_validate(job.config),
                                        device=self.device, job_id=job.id, on_progress=lease.on_progress,
                                        should_cancel=lease.should_cancel, calibration=calibration)
            self._output_files[job.id] = pack_tar(list(iter_output_files(work / "out")), tmp)
            return report
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _adopt(self, job: JobRecord, run: PreparedRun, tmp: Path, lease: _Lease) -> Report | None:
        """The run's Report with its artifact moved to ``tmp``; None (the run discarded) when it cannot be
        used, and the caller quantizes on its own. JobCancelled passes through."""
        try:
            report = run.adopt(lease.on_progress, lease.should_cancel)
            if report is not None:
                os.replace(run.artifact, tmp)
                if self.prepared is not None:
                    self.prepared.adopted_one()
                return report
            log.info("worker %s: job %s: the run during its upload is not usable (%s); quantizing",
                     self.id, job.id, type(run.error).__name__)
        except JobCancelled:
            raise
        except Exception:
            log.exception("worker %s: job %s: adopting the run during its upload failed; quantizing", self.id,
                          job.id)
        run.cancel()  # its artifact goes (now, or as the run ends)
        return None

    def _record(self, end: Callable[..., bool], *args: Any, **kwargs: Any) -> bool:
        """``end(*args, **kwargs)`` (the store's ``complete`` or ``fail``), tried again while the database is
        unavailable, for up to a lease: a restart of the database does not cost the job's work. Each try is
        one transaction that checks the lease, so a retry after a commit whose answer was lost finds the lease
        gone and records nothing twice (``complete``'s ``before_commit`` must be safe to call again)."""
        deadline = time.monotonic() + self.lease_s
        pause = 0.5
        while True:
            try:
                return end(*args, **kwargs)
            except DatabaseUnavailable:
                if time.monotonic() + pause > deadline or self.stop.is_set():
                    raise
                log.warning("worker %s: the database is unavailable; recording again in %.1f s", self.id, pause)
                time.sleep(pause)
                pause = min(pause * 2, 5.0)

    def _end_interrupted(self, job: JobRecord, owner: str) -> None:
        state = self.store.lease_state(job.id, owner)
        if state == "cancel":  # a cancel is never withdrawn: the files go first, then the status
            self.storage.delete_job_files(job.id)
            self.store.finish_cancelled(job.id, owner)
        elif state == "ok" and self.stop.is_set():
            self.store.release(job.id, owner)
        elif state == "ok":  # the pipeline stopped on its own accord: do not leave it running
            self.store.fail(job.id, owner, _error("urn:quantd:internal", "Internal error",
                                                  "the pipeline stopped without a cancel"))
        else:  # "lost": re-queued or ended by someone else (this worker stalled past its lease): nothing to record
            log.warning("worker %s: job %s: the lease was lost (the job was taken over or ended elsewhere); "
                        "this attempt's result is dropped", self.id, job.id)
