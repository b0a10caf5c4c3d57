"""``JobService``: the async facade the HTTP layer uses. Blocking DB and file calls run in threads."""

from __future__ import annotations

import asyncio
import base64
import binascii
import builtins
import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from quantd.errors import naming
from quantd_client import InputInfo, Job, JobList, Progress, QuantConfig, Report

from .backends.s3 import S3Location, parse_s3_url
from .config import JobsConfig, room_to_overlap, worker_devices
from .errors import (
    DestinationInvalid,
    IdempotencyConflict,
    InvalidListQuery,
    JobExpired,
    JobFileNotFound,
    JobNotFound,
    JobNotReady,
    SourceInvalid,
    StorageError,
)
from .pool import WorkerPool, open_backends
from .prepared import PreparedRun, PreparedRuns
from .records import STATUSES, JobRecord
from .references import References, check_access, destination_key, is_prefix
from .signals import JobSignals
from .storage import ArtifactStore, FileSinkLike, LocalStorage, StoredUpload, is_job_id
from .store import JobStore
from .worker import QuantizeFn, owner_is_dead

T = TypeVar("T")
MAX_LIMIT = 100
LISTENING_POLL_S = 1.0


def encode_cursor(created_at: float, job_id: str) -> str:
    raw = json.dumps([created_at, job_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    try:
        created_at, job_id = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        if not isinstance(created_at, (int, float)) or not isinstance(job_id, str):
            raise ValueError(cursor)
    except (ValueError, TypeError, binascii.Error, RecursionError):
        raise InvalidListQuery(f"cursor {cursor[:64]!r} is not one this server issued", field="cursor") from None
    return float(created_at), job_id


@dataclass(frozen=True)
class ArtifactHandle:
    """A succeeded job's artifact as the HTTP layer serves it: a local ``path``, or ``size`` bytes read by
    ``read(start, length)`` (an object store's ranged GETs); ``url`` a presigned URL to redirect to instead."""

    sha256: str
    size: int
    path: Path | None
    url: str | None
    read: Callable[[int, int], Iterator[bytes]]


def _input_info(upload: StoredUpload) -> dict[str, Any]:
    info = {"filename": upload.filename, "bytes": upload.bytes, "sha256": upload.sha256,
            "format": upload.format, "tensors": upload.tensors}
    if upload.files is not None:
        info["files"] = list(upload.files)
    return InputInfo.model_validate(info).model_dump(mode="json", exclude_none=True)


class JobService:
    """Jobs for the HTTP layer: submit, read, list, cancel, follow; embedded workers and reaper.

    ``quantize_fn`` defaults to ``quantd.io.pipeline.quantize_file``; ``config.workers == 0`` runs no
    embedded workers (the API alone, with ``quantd worker`` processes on the same data dir)."""

    def __init__(self, config: JobsConfig, *, quantize_fn: QuantizeFn | None = None) -> None:
        self.config = config
        self._quantize_fn = quantize_fn
        self._store: JobStore | None = None
        self._storage: ArtifactStore | None = None
        self._pool: WorkerPool | None = None
        self.draining = False
        self._prepared: PreparedRuns | None = None
        self._signals = JobSignals()  # this process's workers wake the event streams of their jobs
        self._streams_closed = False
        # The device a queued job shows until a worker claims it (and writes its own): this process's first
        # embedded worker's; None when the workers are other processes.
        self._planned_device: str | None = None
        self._listener: Any = None  # PostgreSQL: LISTEN for other processes' job changes
        self._stream_poll_s = config.events_poll_s  # how often an event stream re-reads its job's row
        self._references: References | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start_sync(self) -> None:
        self.draining = False
        self._store, self._storage = open_backends(self.config)
        storage = self._storage
        self._planned_device = worker_devices(self.config)[0] if self.config.workers != 0 else None
        # Runs during uploads replace the embedded workers' own pipeline, so only when that is the default
        # (and on local files: they read the upload where it is being written).
        if self.config.workers != 0 and self._quantize_fn is None and isinstance(storage, LocalStorage):
            devices = worker_devices(self.config)
            overlap = self.config.quantize_during_upload
            if overlap is None:
                overlap = room_to_overlap(devices)
            if overlap:
                self._prepared = PreparedRuns(
                    new_artifact_path=lambda: storage.new_tmp_path(".part", prefix="run"),
                    capacity=lambda: self._pool.idle() if self._pool else 0,
                    device=lambda: self._pool.idle_device() if self._pool else "cpu",
                    threads=len(devices), on_done=lambda: self._pool.wake.set() if self._pool else None)
        self._pool = WorkerPool(self.config, self._store, self._storage, self._quantize_fn,
                                workers=self.config.workers != 0, on_change=self._signals.notify,
                                prepared=self._prepared)
        self._pool.start()
        conninfo = getattr(self._store, "conninfo", None)
        if conninfo is not None:  # other replicas' and hosts' workers wake this one's event streams at once
            from .backends.postgres import JobListener

            self._listener = JobListener(conninfo, self._signals.notify)
            self._listener.start()
            # Every change wakes the streams: re-reading the row is only the fallback while the listener
            # reconnects, so many followers cost the database a query a second each, not five.
            self._stream_poll_s = max(self.config.events_poll_s, LISTENING_POLL_S)

    def stop_sync(self) -> None:
        if self._listener is not None:
            self._listener.stop()
            self._listener = None
        if self._pool is not None:  # first: jobs running on adopted runs see the shutdown and stop
            self._pool.stop()
        if self._prepared is not None:
            self._prepared.close()
        if self._store is not None:
            self._store.close()
        if self._storage is not None:
            self._storage.release_scratch()
        self._pool = self._store = self._storage = self._prepared = None

    async def start(self) -> None:
        await asyncio.to_thread(self.start_sync)

    async def stop(self) -> None:
        await asyncio.to_thread(self.stop_sync)

    @property
    def store(self) -> JobStore:
        if self._store is None:
            raise RuntimeError("JobService not started")
        return self._store

    @property
    def storage(self) -> ArtifactStore:
        if self._storage is None:
            raise RuntimeError("JobService not started")
        return self._storage

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.to_thread(fn, *args, **kwargs)

    # -- submission --------------------------------------------------------------------------
    @property
    def upload_dir(self) -> Path:
        """The storage's scratch folder of this process, where the server streams the uploads it hands to jobs:
        the storage adopts files from there only (a local ``QUANTD_STORAGE_URL`` need not be the data dir).
        The folder is made (again, if removed) as it is asked for."""
        return self.storage.tmp

    def new_upload_path(self, suffix: str = "") -> Path:
        """A fresh path in the storage's scratch folder (:attr:`upload_dir`) for the server to stream an upload into."""
        return self.storage.new_tmp_path(suffix)

    def prepare(self, upload: Path, config: QuantConfig, *, size_bound: int) -> PreparedRun | None:
        """Start quantizing the upload being written at ``upload`` while it streams (see
        ``quantd.jobs.prepared``), or None when this process has no idle embedded worker for it.
        Thread-safe. Pass the run to :meth:`submit`, or ``discard_prepared`` it if there is no submit."""
        from quantd.io.calibration import uses_calibrated_method

        if self._prepared is None or uses_calibrated_method(config):  # those wait for the calibration file
            return None
        return self._prepared.start(upload, config, size_bound=size_bound)

    @staticmethod
    def new_job_id() -> str:
        """An id for a job whose upload is stored while it streams in (:meth:`stream_upload`), before
        :meth:`submit` (given the same ``job_id``) creates it."""
        return uuid.uuid4().hex

    def stream_upload(self, path: Path, job_id: str, kind: str) -> FileSinkLike | None:
        """A sink that stores the upload being written at ``path`` in the file store while it streams (an
        object store's multipart upload), or None where the file store keeps it where it is written.
        Thread-safe. The upload is the job's once :meth:`submit` adopts it; :meth:`discard_upload` otherwise."""
        if kind not in ("input", "calibration") or not is_job_id(job_id):
            raise ValueError(f"{kind!r} / {job_id!r}")
        return self.storage.stream_upload(path, job_id, "input" if kind == "input" else "calibration")

    def discard_upload(self, path: Path) -> None:
        """An upload no job took: its file, and whatever the file store received of it (thread-safe, idempotent)."""
        self.storage.discard(path)

    def discard_prepared(self, run: PreparedRun) -> None:
        if self._prepared is not None:
            self._prepared.discard(run)

    async def submit(self, *, tenant: str, upload: StoredUpload, config: QuantConfig,
                     calibration: StoredUpload | None = None, idempotency_key: str | None = None,
                     prepared: PreparedRun | None = None, job_id: str | None = None) -> Job:
        """Persist a queued job (committed before this returns) and wake a worker. Takes ownership
        of the upload files: moved under ``uploads/`` or deleted, and of ``prepared`` (a run of
        :meth:`prepare` over this upload): the job's worker adopts it, or it is discarded. An upload
        outside ``data_dir`` is refused (StorageError) and left alone."""
        return await self._run(self._submit, tenant, upload, config, calibration, idempotency_key, prepared,
                               job_id)

    def _submit(self, tenant: str, upload: StoredUpload, config: QuantConfig,
                calibration: StoredUpload | None, idempotency_key: str | None,
                prepared: PreparedRun | None = None, job_id: str | None = None) -> Job:
        if job_id is not None and not is_job_id(job_id):
            raise ValueError(f"{job_id!r} is not a job id")
        job_id, storage = job_id or uuid.uuid4().hex, self.storage
        config_json = config.model_dump(mode="json", exclude_unset=True)
        runs = self._prepared
        if prepared is not None and runs is not None:
            if calibration is None:  # filed before the row commits: the job cannot be claimed without it
                runs.file(job_id, prepared)
            else:  # the run does not observe activations: the worker's pipeline does it all
                runs.discard(prepared)

        def adopt() -> None:
            storage.adopt_upload(upload.path, job_id, "input")
            if calibration is not None:
                storage.adopt_upload(calibration.path, job_id, "calibration")

        try:
            rec, created = self.store.insert(
                job_id=job_id, tenant=tenant, config=config_json, input=_input_info(upload),
                calibration=None if calibration is None else _input_info(calibration),
                idempotency_key=idempotency_key, max_attempts=self.config.max_attempts,
                max_queue=self.config.max_queue, retry_after=self.config.queue_full_retry_after_s,
                before_commit=adopt, device=self._planned_device,
                progress={"tensors_total": upload.tensors})
        except BaseException:
            if prepared is not None and runs is not None:
                runs.discard(prepared, job_id)
            storage.delete_job_files(job_id)
            raise
        finally:
            for u in (upload, calibration):
                if u is not None:
                    storage.discard(u.path)
        if not created and prepared is not None and runs is not None:  # the key's earlier job stands
            runs.discard(prepared, job_id)
        if not created and (rec.input.get("sha256") != upload.sha256 or rec.config != config_json):
            raise IdempotencyConflict(f"idempotency key {idempotency_key!r} was used for job {rec.id} "
                                      "with a different input or config", field="idempotency_key")
        if created and self._pool is not None:
            self._pool.wake.set()
        return rec.to_job()

    async def submit_reference(self, *, tenant: str, source: str, destination: str | None, config: QuantConfig,
                               max_bytes: int, idempotency_key: str | None = None) -> Job:
        """Persist a job that reads ``source`` (an ``s3://`` model file) and writes its artifact to
        ``destination`` too. SourceForbidden (403) before anything is fetched unless both are under the
        tenant's allowed prefixes; the object's header is read and the config planned against it (415/422)
        before the job is accepted, as for an upload."""
        return await self._run(self._submit_reference, tenant, source, destination, config, max_bytes,
                               idempotency_key)

    @staticmethod
    def _check_not_over_source(loc: S3Location, dst: S3Location, config: QuantConfig,
                               rels: Sequence[str] | None) -> None:
        """DestinationInvalid (422) when a key the output writes is one of the source's: a one-file output's key,
        or under a prefix the output directory's files (a directory source's relative paths, their shards as
        safetensors, and config.json; a one-file source's model.safetensors and config.json). ``rels``: a
        directory source's relative paths, None for one object."""
        from quantd.io.model_dir import CONFIG, output_relpath
        from quantd.io.outputs import artifact_suffix, get_format

        if dst.bucket != loc.bucket:
            return
        if rels is None and not get_format(config.output).writes_config:
            written = {parse_s3_url(destination_key(dst.url, loc.url, artifact_suffix(config.output))).key}
        elif is_prefix(dst):
            names = {output_relpath(r) for r in rels} if rels is not None else {"model.safetensors"}
            written = {dst.key + r for r in names | {CONFIG}}
        else:
            return  # a directory output needs a prefix: refused as such below
        sources = {loc.key + r for r in rels} if rels is not None else {loc.key}
        clash = sorted(written & sources)
        if clash:
            raise DestinationInvalid(f"destination {dst.url[:200]!r} would write over the source's "
                                     f"s3://{loc.bucket}/{clash[0][:200]}: choose another key or prefix",
                                     field="destination")

    def _submit_reference(self, tenant: str, source: str, destination: str | None, config: QuantConfig,
                          max_bytes: int, idempotency_key: str | None) -> Job:
        from quantd import io
        from quantd.io.outputs import get_format

        rules = self.config.source_prefixes
        loc = check_access(rules, tenant, source, field="source")
        directory = is_prefix(loc)
        dst = check_access(rules, tenant, destination, field="destination") if destination is not None else None
        if destination is not None and not destination.endswith("/") and (
                directory or get_format(config.output).writes_config):
            raise DestinationInvalid(f"destination {destination[:200]!r}: this job writes a model directory, so "
                                     "its destination is a prefix ending in '/'", field="destination")
        if directory:
            info = self._check_source_directory(loc, config, max_bytes)
            tensors = int(info["tensors"])
            if dst is not None:
                self._check_not_over_source(loc, dst, config, [f["path"] for f in info["files"]])
        else:
            if dst is not None:
                self._check_not_over_source(loc, dst, config, None)
            obj = self.references.head(loc, max_bytes=max_bytes)
            filename = loc.key.rsplit("/", 1)[-1]
            sample = self.storage.new_tmp_path(prefix="source")
            try:
                self.references.sample(obj, sample)
                fmt, tensors = io.detect_format(sample), 0
                from quantd.io.outputs.gguf import check_format

                check_format(fmt, config)
                if fmt == "safetensors":  # the whole header is in the sample: the same checks as an upload's
                    with io.open_model(sample, filename=filename) as reader:
                        infos = list(reader.tensors)
                    io.plan(infos, config)
                    tensors = len(infos)
            finally:
                self.storage.discard(sample)
            info = {"filename": filename, "bytes": obj.bytes, "sha256": "", "format": fmt, "tensors": tensors,
                    "etag": obj.etag}
        info.update({"source": loc.url, "destination": destination})
        job_id = uuid.uuid4().hex
        config_json = config.model_dump(mode="json", exclude_unset=True)
        rec, created = self.store.insert(
            job_id=job_id, tenant=tenant, config=config_json, input=info, calibration=None,
            idempotency_key=idempotency_key, max_attempts=self.config.max_attempts,
            max_queue=self.config.max_queue, retry_after=self.config.queue_full_retry_after_s,
            before_commit=lambda: None, device=self._planned_device, progress={"tensors_total": tensors})
        if not created and ((rec.input.get("source"), rec.input.get("etag"), rec.input.get("destination"))
                            != (loc.url, info["etag"], destination) or rec.config != config_json):
            raise IdempotencyConflict(f"idempotency key {idempotency_key!r} was used for job {rec.id} "
                                      "with a different source, destination or config", field="idempotency_key")
        if created and self._pool is not None:
            self._pool.wake.set()
        return rec.to_job()

    def _check_source_directory(self, loc: S3Location, config: QuantConfig, max_bytes: int) -> dict[str, Any]:
        """A directory source listed and checked as an uploaded directory is before its 202: every path, the
        shards against the index, the config against every tensor. Only headers and JSON files are read: each
        safetensors shard is sampled (its header), ``config.json`` and indexes fetched, the rest left sparse."""
        import shutil

        from quantd import io
        from quantd.io.model_dir import (
            CONFIG,
            INDEX_SUFFIX,
            MAX_JSON_BYTES,
            ModelFiles,
            check_no_folder_clash,
            is_weight_file,
            plan_directory,
        )

        listing = self.references.list_directory(loc, max_bytes=max_bytes)
        with naming(f"source {loc.url!r}"):
            check_no_folder_clash((rel for rel, _ in listing.files), field="source")
        work = self.storage.new_tmp_path(prefix="source")
        work.mkdir()
        try:
            local: dict[str, Path] = {}
            for rel, obj in listing.files:
                dst = work / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                if is_weight_file(rel) and not rel.endswith(".safetensors"):
                    raise SourceInvalid(f"source {loc.url!r}: {rel!r} is not safetensors; a directory named by "
                                        "reference is read shard by shard from its headers (upload a PyTorch "
                                        "checkpoint directory as parts instead)", field="source")
                if is_weight_file(rel):
                    self.references.sample(obj, dst)
                elif (rel == CONFIG or rel.endswith(INDEX_SUFFIX)) and obj.bytes <= MAX_JSON_BYTES:
                    self.references.stage(obj.location.url, obj.etag, dst)
                else:  # not read by the checks: its size only
                    with open(dst, "wb") as f:
                        f.truncate(obj.bytes)
                local[rel] = dst
            model = ModelFiles(local)
            if not model.weights:
                raise SourceInvalid(f"source {loc.url!r}: no weight files (*.safetensors) under this prefix",
                                    field="source")
            plans, _ = plan_directory(model, config)
            fmt = io.detect_format(local[model.weights[0]])
        finally:
            shutil.rmtree(work, ignore_errors=True)
        name = loc.key.rstrip("/").rsplit("/", 1)[-1] or loc.bucket
        return {"filename": name, "bytes": listing.bytes, "sha256": "", "format": fmt,
                "tensors": sum(len(p) for p in plans.values()), "etag": listing.etag,
                "files": [{"path": rel, "bytes": obj.bytes, "sha256": ""} for rel, obj in listing.files],
                "source_etags": {rel: obj.etag for rel, obj in listing.files}}

    @property
    def references(self) -> References:
        if self._references is None:
            self._references = References.for_storage(self.storage, self.config.s3_endpoint_url)
        return self._references

    # -- reads -------------------------------------------------------------------------------
    def _record(self, tenant: str, job_id: str) -> JobRecord:
        rec = self.store.get(job_id) if is_job_id(job_id) else None
        if rec is None or rec.tenant != tenant:
            raise JobNotFound(f"job {job_id[:64]!r} not found", field="job_id")
        return rec

    async def get(self, tenant: str, job_id: str) -> Job:
        return (await self._run(self._record, tenant, job_id)).to_job()

    async def list(self, tenant: str, *, status: str | None = None, limit: int = 20,
                   cursor: str | None = None) -> JobList:
        if status is not None and status not in STATUSES:
            raise InvalidListQuery(f"status {status[:32]!r} is not one of {list(STATUSES)}", field="status")
        if not 1 <= limit <= MAX_LIMIT:
            raise InvalidListQuery(f"limit {limit} is not in [1, {MAX_LIMIT}]", field="limit")
        after = None if cursor is None else decode_cursor(cursor)
        recs = await self._run(self.store.list_jobs, tenant, status=status, limit=limit + 1, after=after)
        page = recs[:limit]
        next_cursor = encode_cursor(page[-1].created_at, page[-1].id) if len(recs) > limit else None
        return JobList(items=[r.to_job() for r in page], next_cursor=next_cursor)

    async def cancel(self, tenant: str, job_id: str) -> Job:
        """queued → cancelled, files deleted; running → cancel asked: its worker ends it ``cancelled`` at
        its next tensor and deletes the files, and this waits up to ``cancel_wait_s`` for that (the job
        is returned still ``running``, with ``cancel_requested``, when its tensor takes longer);
        finished → its files are deleted (report/artifact then raise JobExpired)."""
        job = await self._run(self._cancel, tenant, job_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.cancel_wait_s
        while job.status == "running" and (left := deadline - loop.time()) > 0:
            await self._signals.wait(job_id, min(left, self.config.events_poll_s))  # woken by local workers
            job = await self.get(tenant, job_id)
        return job

    def _cancel(self, tenant: str, job_id: str) -> Job:
        rec = self._record(tenant, job_id)
        if rec.terminal:
            self.storage.delete_job_files(job_id)
            self.store.mark_expired(job_id)
            return self._record(tenant, job_id).to_job()  # with its expired_at
        after = self.store.request_cancel(job_id) or rec
        if after.status == "cancelled":
            run = self._prepared.pop(job_id) if self._prepared is not None else None
            if run is not None:  # quantizing during its upload: stopped, its artifact deleted
                run.cancel()
            self.storage.delete_job_files(job_id)
            self._signals.notify(job_id)
        return after.to_job()

    def _succeeded(self, tenant: str, job_id: str) -> JobRecord:
        rec = self._record(tenant, job_id)
        if rec.status != "succeeded":
            why = ""
            if rec.status == "failed" and rec.error:  # the reason, where a client that only downloads sees it
                why = f" ({rec.error.get('title', 'failed')}: {rec.error.get('detail', '')})"
            raise JobNotReady(f"job {job_id} is {rec.status}{why}; its report and artifact exist once it has "
                              "succeeded", field="status")
        if rec.expired_at is not None:
            raise JobExpired(f"the files of job {job_id} were deleted (TTL {self.config.ttl_s:g} s or DELETE)")
        return rec

    async def report(self, tenant: str, job_id: str) -> Report:
        def read() -> Report:
            self._succeeded(tenant, job_id)
            text = self.storage.get_report(job_id)
            if text is None:
                raise JobExpired(f"the report of job {job_id} is gone")
            return Report.model_validate_json(text)

        return await self._run(read)

    async def artifact_path(self, tenant: str, job_id: str) -> tuple[Path, str]:
        """The artifact's local path and sha256 (its ETag), on a file store that keeps artifacts as local files
        (an object store's are read with :meth:`artifact`: StorageError here). JobNotReady (409) until
        succeeded; JobExpired (410) once its files are deleted."""
        def find() -> tuple[Path, str]:
            rec = self._succeeded(tenant, job_id)
            path = self.storage.local_artifact(job_id)
            if path is None and self.storage.artifact_info(job_id) is not None:
                raise StorageError(f"the artifact of job {job_id} is in the object store: read it by range",
                                   field="storage_url")
            if path is None or rec.result is None:
                raise JobExpired(f"the artifact of job {job_id} is gone")
            return path, str(rec.result["artifact_sha256"])

        return await self._run(find)

    async def files(self, tenant: str, job_id: str) -> list[dict[str, Any]]:
        """The job's output files ``[{"path","bytes","sha256"}]``: a directory output's, or the one artifact
        (named ``{input stem}`` and the format's suffix: ``.quantd.safetensors``, ``.gguf``). 409 until succeeded;
        410 once deleted."""
        def listing() -> list[dict[str, Any]]:
            return self._output_files(self._succeeded(tenant, job_id), job_id)

        return await self._run(listing)

    def _output_files(self, rec: Any, job_id: str) -> list[dict[str, Any]]:
        result = rec.result or {}
        if result.get("files") is not None:
            return list(result["files"])
        from quantd.io.outputs import artifact_suffix

        stem = Path(str(rec.input.get("filename") or "model")).stem or "model"
        output = str((rec.config or {}).get("output") or "safetensors")
        return [{"path": f"{stem}{artifact_suffix(output)}", "bytes": result.get("artifact_bytes", 0),
                 "sha256": result.get("artifact_sha256", "")}]

    async def output_file(self, tenant: str, job_id: str, path: str
                          ) -> tuple[ArtifactHandle, tuple[int, int] | None]:
        """One output file: the artifact holding it (its ``sha256`` the file's own) and where the file's bytes
        lie in it, ``(offset, size)`` (None: all of it). JobFileNotFound (404) for a path the job did not
        write; 409 until succeeded; 410 once deleted."""
        def find() -> tuple[ArtifactHandle, tuple[int, int] | None]:
            from quantd.io.model_dir import tar_window

            rec = self._succeeded(tenant, job_id)
            entry = next((f for f in self._output_files(rec, job_id) if f["path"] == path), None)
            if entry is None:
                raise JobFileNotFound(f"job {job_id} has no output file {path!r} (GET /v1/jobs/{job_id}/files "
                                      "lists them)", field="path")
            storage = self.storage
            size = storage.artifact_info(job_id)
            if size is None or rec.result is None:
                raise JobExpired(f"the artifact of job {job_id} is gone")
            handle = ArtifactHandle(sha256=str(entry["sha256"]), size=size, path=storage.local_artifact(job_id),
                                    url=None, read=lambda start, length: storage.read_artifact(job_id, start, length))
            if rec.result.get("files") is None:
                return handle, None
            window = tar_window(lambda start, length: b"".join(storage.read_artifact(job_id, start, length)),
                                size, path)
            if window is None:
                raise JobExpired(f"the file {path!r} of job {job_id} is gone")
            return handle, window

        return await self._run(find)

    async def artifact(self, tenant: str, job_id: str, *, filename: str) -> ArtifactHandle:
        """The artifact wherever the file store keeps it (see :class:`ArtifactHandle`); JobNotReady (409)
        until succeeded, JobExpired (410) once deleted."""
        def find() -> ArtifactHandle:
            rec = self._succeeded(tenant, job_id)
            storage = self.storage
            size = storage.artifact_info(job_id)
            if size is None or rec.result is None:
                raise JobExpired(f"the artifact of job {job_id} is gone")
            return ArtifactHandle(sha256=str(rec.result["artifact_sha256"]), size=size,
                                  path=storage.local_artifact(job_id), url=storage.artifact_url(job_id, filename),
                                  read=lambda start, length: storage.read_artifact(job_id, start, length))

        return await self._run(find)

    async def events(self, tenant: str, job_id: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """("progress", Progress) first and on every change, then one terminal (status, Job) event.
        Raises JobNotFound on the first step (call ``get`` first to answer 404 before streaming)."""
        rec = await self._run(self._record, tenant, job_id)
        last: dict[str, Any] | None = None
        while not rec.terminal:
            if self._streams_closed:  # the server is stopping: end here; the client polls or reconnects
                return
            progress = Progress.model_validate(rec.progress).model_dump(mode="json")
            if progress != last:
                last = progress
                yield "progress", progress
            # A local worker's write wakes the stream at once; other processes' are seen at the next poll.
            await self._signals.wait(job_id, self._stream_poll_s)
            rec = await self._run(self._record, tenant, job_id)
        yield rec.status, rec.to_job().model_dump(mode="json")

    def begin_shutdown(self) -> None:
        """The process was asked to stop (from any thread): workers claim no more jobs (one accepted now waits
        in the queue for the next start), uploads in flight are answered 503 (:attr:`draining`), and event
        streams end; running jobs go on until :meth:`stop` gives them back to the queue."""
        self.draining = True
        if self._pool is not None:
            self._pool.drain()
        self.close_streams()

    def close_streams(self) -> None:
        """End every event stream of an unfinished job now (from any thread): a stopping server waits for
        its open connections, and a stream kept it waiting its whole graceful timeout (30 s), then was cut
        mid-chunk. Streams started afterwards end at once too."""
        self._streams_closed = True
        self._signals.notify_all()

    # -- metrics and readiness ----------------------------------------------------------------
    def queue_depth(self) -> int:
        return self.store.queue_depth()

    def counts_by_status(self) -> dict[str, int]:
        return self.store.counts_by_status()

    def succeeded_input_bytes(self) -> int:
        """Input bytes of the jobs that succeeded, on any worker (the store's count)."""
        return self.store.succeeded_input_bytes()

    def _remote_workers(self) -> builtins.list[dict[str, Any]]:
        """Other processes' workers with a heartbeat within lease_s, less those whose process on this host is
        gone (a worker killed with SIGKILL counted as live, and busy, until its heartbeat aged out)."""
        local = {w.id for w in self._pool.workers} if self._pool else set()
        return [w for w in self.store.live_workers(self.config.lease_s)
                if w["id"] not in local and not owner_is_dead(w["id"])]

    def upload_runs(self) -> dict[str, int]:
        """Quantizations started during uploads, and those whose artifact became their job's."""
        runs = self._prepared
        return {"started": runs.started, "adopted": runs.adopted} if runs else {"started": 0, "adopted": 0}

    def busy_workers(self) -> int:
        """Workers running a job: this process's, plus other worker processes on the same DB."""
        local = self._pool.busy() if self._pool else 0
        return local + sum(w["busy_job"] is not None for w in self._remote_workers())

    def live_workers(self) -> int:
        """Workers alive: this process's threads, plus other processes' with a heartbeat within lease_s."""
        return (self._pool.alive() if self._pool else 0) + len(self._remote_workers())

    def ready(self) -> dict[str, Any]:
        """``{"database": bool, "storage": bool, "workers": int}``; ready when all are truthy.
        Blocking (a DB query and a probe file): call it from a thread."""
        if self._store is None or self._storage is None:
            return {"database": False, "storage": False, "workers": 0}
        database = self._store.ping()
        try:
            workers = self.live_workers() if database else 0
        except Exception:  # the database went away between the two queries
            database, workers = False, 0
        return {"database": database, "storage": self._storage.writable(), "workers": workers}
