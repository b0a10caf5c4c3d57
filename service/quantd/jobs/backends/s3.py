"""Job files in an S3-compatible bucket (AWS S3, MinIO, Ceph RGW, GCS's S3 API), through boto3.

Objects under ``s3://bucket/prefix``: ``uploads/{id}.input`` (+ ``.calibration``), ``artifacts/{id}.safetensors``,
``reports/{id}.json``. Keys are built from job ids only. What a process reads or writes whole (an upload
being received, an artifact being written, a job's input while a worker quantizes it) lives on its local
scratch directory (``data_dir/tmp``) and moves to or from the bucket as a stream: multipart transfers of
:data:`PART_BYTES` parts, at most :data:`TRANSFER_THREADS` in flight, so memory stays bounded whatever the
file's size. Artifacts are served from any replica by byte range (or a presigned URL).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import scratch
from ..errors import StorageError
from ..storage import LocalStorage, StoredArtifact, UploadKind, is_job_id

log = logging.getLogger("quantd.jobs")

PART_BYTES = 8 * 1024 * 1024
TRANSFER_THREADS = 4
READ_CHUNK = 1024 * 1024
PRESIGN_TTL_S = 900
# Listing the bucket for leftovers costs a request per 1000 objects: every process's reaper does it at most
# this often (the leftovers it looks for are hours old anyway).
LIST_INTERVAL_S = 300.0
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class S3Location:
    bucket: str
    key: str  # a key, or a prefix ending in "/" ("" for the whole bucket)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


def parse_s3_url(url: str, *, field: str = "url") -> S3Location:
    """``s3://bucket/key...`` → its bucket and key. Refused (StorageError naming ``field``): another scheme,
    a bad bucket name, and keys with empty, ``.`` or ``..`` segments, backslashes or control characters
    (an object store takes them literally, but a prefix check on such a key means nothing)."""
    if not url.startswith("s3://"):
        raise StorageError(f"{url[:200]!r} is not an s3:// URL", field=field)
    bucket, _, key = url[5:].partition("/")
    if not _BUCKET.match(bucket):
        raise StorageError(f"{bucket[:80]!r} is not an S3 bucket name", field=field)
    segments = key.split("/")
    inner = segments[:-1] if key.endswith("/") else segments
    if key and any(s in ("", ".", "..") for s in inner):
        raise StorageError(f"{url[:200]!r}: empty, '.' or '..' path segments", field=field)
    if "\\" in key or any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise StorageError(f"{url[:200]!r}: backslashes or control characters", field=field)
    return S3Location(bucket, key)


def make_client(endpoint_url: str | None = None) -> Any:
    """A boto3 S3 client: endpoint from ``endpoint_url`` (``QUANTD_S3_ENDPOINT_URL``) or boto3's own
    ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``; credentials and region from the usual ``AWS_*`` variables,
    files and instance roles. Path-style addressing with a custom endpoint (MinIO, Ceph, test servers)."""
    import boto3
    from botocore.config import Config

    style = "path" if endpoint_url else "auto"
    config = Config(retries={"max_attempts": 5, "mode": "standard"}, s3={"addressing_style": style},
                    connect_timeout=10, read_timeout=60, max_pool_connections=32)
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url or None, config=config)


def transfer_config() -> Any:
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES,
                          max_concurrency=TRANSFER_THREADS, io_chunksize=READ_CHUNK)


def _missing(error: Exception) -> bool:
    from botocore.exceptions import ClientError

    return isinstance(error, ClientError) and error.response.get("Error", {}).get("Code") in (
        "404", "NoSuchKey", "NotFound")


class StreamingUpload:
    """An upload sent to the bucket while the request still streams in (the ``FileSink`` the upload parser
    tells how far the file is written): a thread reads each PART_BYTES of the file from scratch once it is
    written and sends it as a part of a multipart upload, so at most one part is held in memory and the object
    is complete moments after the body. A file smaller than a part is one PUT at the end. Any failure or an
    abort aborts the multipart upload; :meth:`wait` says whether the object was stored."""

    def __init__(self, client: Any, path: Path, bucket: str, key: str) -> None:
        self.client, self.path, self.bucket, self.key = client, path, bucket, key
        self.error: BaseException | None = None
        self.stored = False
        self._written = self._sent = 0
        self._done = self._aborted = False
        self._parts: list[dict[str, Any]] = []
        self._upload_id: str | None = None
        self._cond = threading.Condition()
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name="quantd-s3-upload", daemon=True)
        self._thread.start()

    # -- FileSink ------------------------------------------------------------------------------
    def advance(self, nbytes: int) -> None:
        with self._cond:
            self._written = nbytes
            self._cond.notify()

    def complete(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify()

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the object was stored, once the thread has finished (False on timeout)."""
        return self._finished.wait(timeout) and self.stored

    # -- the sender ------------------------------------------------------------------------------
    def _next(self) -> tuple[int, bool] | None:
        """The size of the next part to send and whether it is the last; None when aborted."""
        with self._cond:
            while not self._aborted and not self._done and self._written - self._sent < PART_BYTES:
                self._cond.wait()
            if self._aborted:
                return None
            n = min(self._written - self._sent, PART_BYTES)
            return n, self._done and self._sent + n == self._written

    def _run(self) -> None:
        try:
            step = self._next()  # the file is opened once its first part is written
            if step is None:
                return
            with open(self.path, "rb") as f:
                while step is not None:
                    n, last = step
                    f.seek(self._sent)
                    data = f.read(n)
                    if len(data) != n:
                        raise OSError(f"read {len(data)} of {n} bytes of {self.path.name}")
                    if last and self._upload_id is None:  # the whole file fits in one part: one PUT
                        self.client.put_object(Bucket=self.bucket, Key=self.key, Body=data)
                        self.stored = True
                        return
                    if self._upload_id is None:
                        self._upload_id = self.client.create_multipart_upload(Bucket=self.bucket,
                                                                              Key=self.key)["UploadId"]
                    if n:  # (nothing left for the last part when the file ends on a part boundary)
                        number = len(self._parts) + 1
                        etag = self.client.upload_part(Bucket=self.bucket, Key=self.key, UploadId=self._upload_id,
                                                       PartNumber=number, Body=data)["ETag"]
                        self._parts.append({"PartNumber": number, "ETag": etag})
                        self._sent += n
                    if last:
                        self.client.complete_multipart_upload(Bucket=self.bucket, Key=self.key,
                                                              UploadId=self._upload_id,
                                                              MultipartUpload={"Parts": self._parts})
                        self.stored = True
                        return
                    step = self._next()
        except BaseException as e:  # the caller falls back to sending the file whole
            self.error = e
            log.warning("streaming upload to s3://%s/%s failed: %s", self.bucket, self.key, e)
        finally:
            if not self.stored and self._upload_id is not None:
                with contextlib.suppress(Exception):
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self._upload_id)
            self._finished.set()


class S3Storage:
    """The ``ArtifactStore`` protocol over one bucket prefix, with ``scratch`` (a :class:`LocalStorage` under
    the data dir) for the files a process holds while it works on them."""

    def __init__(self, url: str, scratch_dir: Path, *, endpoint_url: str | None = None, presign: bool = False,
                 client: Any = None) -> None:
        loc = parse_s3_url(url, field="storage_url")
        if loc.key and not loc.key.endswith("/"):
            loc = S3Location(loc.bucket, loc.key + "/")
        self.location = loc
        self.bucket, self.prefix = loc.bucket, loc.key
        self.presign = presign
        self.client = client if client is not None else make_client(endpoint_url)
        self.scratch = LocalStorage(scratch_dir)
        self._transfer = transfer_config()
        self._streams: dict[Path, StreamingUpload] = {}
        self._streams_lock = threading.Lock()
        self._listed: dict[str, float] = {}  # what was last listed for leftovers, and when (monotonic)

    def _list_due(self, what: str) -> bool:
        now = time.monotonic()
        if now - self._listed.get(what, -LIST_INTERVAL_S) < LIST_INTERVAL_S:
            return False
        self._listed[what] = now
        return True

    # -- keys -----------------------------------------------------------------------------------
    def _key(self, folder: str, job_id: str, suffix: str) -> str:
        if not is_job_id(job_id):
            raise StorageError(f"{job_id!r} is not a job id", field="job_id")
        return f"{self.prefix}{folder}/{job_id}{suffix}"

    def upload_key(self, job_id: str, kind: UploadKind) -> str:
        return self._key("uploads", job_id, f".{kind}")

    def artifact_key(self, job_id: str) -> str:
        return self._key("artifacts", job_id, ".safetensors")

    def report_key(self, job_id: str) -> str:
        return self._key("reports", job_id, ".json")

    def _job_keys(self, job_id: str) -> list[str]:
        return [self.upload_key(job_id, "input"), self.upload_key(job_id, "calibration"),
                self.artifact_key(job_id), self.report_key(job_id)]

    # -- transfers --------------------------------------------------------------------------------
    def put_file(self, path: Path, bucket: str, key: str) -> None:
        """A local file to ``bucket/key``: one PUT, or a multipart upload in PART_BYTES parts (aborted on
        failure); the object appears whole or not at all."""
        self.client.upload_file(str(path), bucket, key, Config=self._transfer)

    def get_file(self, bucket: str, key: str, dst: Path) -> None:
        """``bucket/key`` to a local file, by ranged GETs of PART_BYTES."""
        self.client.download_file(bucket, key, str(dst), Config=self._transfer)

    def head(self, bucket: str, key: str) -> dict[str, Any] | None:
        try:
            return dict(self.client.head_object(Bucket=bucket, Key=key))
        except Exception as e:
            if _missing(e):
                return None
            raise

    def read_range(self, bucket: str, key: str, start: int, length: int) -> Iterator[bytes]:
        """``length`` bytes of an object from ``start``, in chunks of READ_CHUNK."""
        if length <= 0:
            return
        body = self.client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + length - 1}")["Body"]
        try:
            yield from body.iter_chunks(READ_CHUNK)
        finally:
            body.close()

    # -- the ArtifactStore protocol -------------------------------------------------------------
    @property
    def tmp(self) -> Path:
        """This process's scratch folder (the local scratch's)."""
        return self.scratch.tmp

    def init(self) -> None:
        self.scratch.init()
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as e:
            raise StorageError(f"bucket {self.bucket!r} is not reachable: {e}", field="storage_url") from e

    def new_tmp_path(self, suffix: str = "", *, prefix: str = "upload") -> Path:
        return self.scratch.new_tmp_path(suffix, prefix=prefix)

    def stream_upload(self, path: Path, job_id: str, kind: UploadKind) -> StreamingUpload:
        """Start sending the upload being written at ``path`` (on scratch) to the job's key while it streams;
        :meth:`adopt_upload` then finds it stored, and :meth:`discard` removes it if no job takes it."""
        path = self.scratch.inside(path)
        sink = StreamingUpload(self.client, path, self.bucket, self.upload_key(job_id, kind))
        with self._streams_lock:
            self._streams[path] = sink
        return sink

    def _pop_stream(self, path: Path) -> StreamingUpload | None:
        with self._streams_lock:
            return self._streams.pop(Path(path).resolve(), None)

    def adopt_upload(self, src: Path, job_id: str, kind: UploadKind) -> None:
        """The upload in the bucket under the job's key (already there when it was streamed during the request;
        else sent now as a multipart transfer), its scratch copy removed; the job row is committed after."""
        src = self.scratch.inside(src)
        key = self.upload_key(job_id, kind)
        sink = self._pop_stream(src)
        if sink is not None and not (sink.key == key and sink.wait()):
            sink.abort()
            sink.wait()
            if sink.stored and sink.key != key:
                self.client.delete_object(Bucket=self.bucket, Key=sink.key)
            sink = None
        if sink is None:
            self.put_file(src, self.bucket, key)
        src.unlink(missing_ok=True)

    def discard(self, path: Path) -> None:
        """A leftover upload: its scratch file, and the object it was being streamed to if no job took it."""
        sink = self._pop_stream(path)
        if sink is not None:
            sink.abort()
            sink.wait()
            if sink.stored:
                self.client.delete_object(Bucket=self.bucket, Key=sink.key)
        self.scratch.discard(path)

    def upload_path(self, job_id: str, kind: UploadKind) -> Path:
        """Where :meth:`stage_upload` puts a local copy (one per call: see there)."""
        self._key("uploads", job_id, "")
        return self.scratch.inside(self.tmp / f"staged-{job_id}-{uuid.uuid4().hex[:12]}.{kind}")

    def stage_upload(self, job_id: str, kind: UploadKind) -> Path | None:
        """A local copy of the job's upload on scratch for a worker to read (its own: :meth:`unstage` it), or
        None when the upload is gone."""
        dst = self.upload_path(job_id, kind)
        try:
            self.get_file(self.bucket, self.upload_key(job_id, kind), dst)
        except Exception as e:
            dst.unlink(missing_ok=True)
            if _missing(e):
                return None
            raise
        return dst

    def unstage(self, path: Path) -> None:
        self.scratch.discard(path)

    def artifact_tmp_path(self, job_id: str) -> Path:
        return self.scratch.artifact_tmp_path(job_id)

    def commit_artifact(self, tmp: Path, job_id: str) -> StoredArtifact:
        sha256, size = self.seal_artifact(tmp)
        self.install_artifact(tmp, job_id)
        return StoredArtifact(path=Path(self.artifact_key(job_id)), bytes=size, sha256=sha256)

    def seal_artifact(self, tmp: Path) -> tuple[str, int]:
        return self.scratch.seal_artifact(tmp)

    def install_artifact(self, tmp: Path, job_id: str) -> None:
        tmp = self.scratch.inside(tmp)
        self.put_file(tmp, self.bucket, self.artifact_key(job_id))
        tmp.unlink(missing_ok=True)

    def artifact_path(self, job_id: str) -> Path:
        """Artifacts are objects here, read with :meth:`artifact_info` and :meth:`read_artifact`."""
        raise StorageError("artifacts live in the object store, not on a local path", field="storage_url")

    def local_artifact(self, job_id: str) -> Path | None:
        return None

    def artifact_info(self, job_id: str) -> int | None:
        """The artifact's size in bytes, or None when it is gone."""
        meta = self.head(self.bucket, self.artifact_key(job_id))
        return None if meta is None else int(meta["ContentLength"])

    def read_artifact(self, job_id: str, start: int, length: int) -> Iterator[bytes]:
        return self.read_range(self.bucket, self.artifact_key(job_id), start, length)

    def artifact_url(self, job_id: str, filename: str) -> str | None:
        """A presigned GET of the artifact (valid PRESIGN_TTL_S) when presigning is on, else None."""
        if not self.presign:
            return None
        return str(self.client.generate_presigned_url(
            "get_object", ExpiresIn=PRESIGN_TTL_S,
            Params={"Bucket": self.bucket, "Key": self.artifact_key(job_id),
                    "ResponseContentDisposition": f'attachment; filename="{filename}"'}))

    def put_report(self, job_id: str, report_json: str) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.report_key(job_id), Body=report_json.encode(),
                               ContentType="application/json")

    def stage_report(self, job_id: str, report_json: str) -> Path:
        return self.scratch.stage_report(job_id, report_json)

    def install_report(self, tmp: Path, job_id: str) -> None:
        tmp = self.scratch.inside(tmp)
        self.put_report(job_id, tmp.read_text(encoding="utf-8"))
        tmp.unlink(missing_ok=True)

    def get_report(self, job_id: str) -> str | None:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.report_key(job_id))["Body"]
        except Exception as e:
            if _missing(e):
                return None
            raise
        with body:
            return str(body.read().decode("utf-8"))

    def delete_job_files(self, job_id: str) -> None:
        """The job's objects, and the drafts of its attempts on this host's scratch."""
        self.client.delete_objects(Bucket=self.bucket, Delete={
            "Objects": [{"Key": k} for k in self._job_keys(job_id)], "Quiet": True})
        self.scratch.delete_job_files(job_id)
        # any process's scratch on this data dir (a dead attempt's staged inputs)
        for staged in scratch.glob_all(self.scratch.tmp_root, f"staged-{job_id}-*"):
            staged.unlink(missing_ok=True)

    def writable(self) -> bool:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception:
            return False
        return self.scratch.writable()

    def release_scratch(self) -> None:
        self.scratch.release_scratch()

    def sweep_tmp(self, older_than_s: float) -> int:
        """Scratch leftovers, and multipart uploads under the prefix that a process began and never
        finished (it died mid-transfer): their parts are stored, and billed, until aborted."""
        n = self.scratch.sweep_tmp(older_than_s)
        if not self._list_due("multipart"):
            return n
        cutoff = time.time() - older_than_s
        pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=self.prefix)
        for page in pages:
            for up in page.get("Uploads", []):
                if up["Initiated"].timestamp() < cutoff:
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                    n += 1
        return n

    def list_upload_ids(self, older_than_s: float) -> list[str]:
        """Job ids of uploads older than ``older_than_s`` (at most every LIST_INTERVAL_S: else none)."""
        if not self._list_due("uploads"):
            return []
        cutoff, ids = time.time() - older_than_s, set()
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                      Prefix=f"{self.prefix}uploads/")
        for page in pages:
            for obj in page.get("Contents", []):
                stem = obj["Key"].rsplit("/", 1)[-1].split(".", 1)[0]
                if is_job_id(stem) and obj["LastModified"].timestamp() < cutoff:
                    ids.add(stem)
        return sorted(ids)

    def list_keys(self) -> list[str]:
        """Every object under the prefix (for operators and tests)."""
        keys: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
            keys += [obj["Key"] for obj in page.get("Contents", [])]
        return keys
