"""Where a job's files live: the ``ArtifactStore`` interface and its local-disk implementation.

Layout under ``data_dir``: ``uploads/{id}.input`` (+ ``{id}.calibration``), ``artifacts/{id}.safetensors``,
``reports/{id}.json``, ``tmp/`` (uploads being received, artifacts being written). Paths are built
from job ids only (32 hex digits, checked), never from client filenames, and every path is checked
to resolve inside ``data_dir``.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from quantd.io.files import fsync_dir, sha256_file

from . import scratch
from .errors import StorageError

UploadKind = Literal["input", "calibration"]
_JOB_ID = re.compile(r"^[0-9a-f]{32}$")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class StoredUpload:
    """An upload the server has stored under ``data_dir`` (see ``ArtifactStore.new_tmp_path``).

    ``filename`` is the client's, for display only; it never names a file on disk."""

    path: Path
    filename: str
    bytes: int
    sha256: str
    format: str
    tensors: int
    # A model directory (stored as one uncompressed tar at ``path``): its files' path, bytes and sha256.
    files: tuple[dict[str, Any], ...] | None = None


@dataclass(frozen=True)
class StoredArtifact:
    path: Path
    bytes: int
    sha256: str


def is_job_id(job_id: str) -> bool:
    return bool(_JOB_ID.match(job_id))


class FileSinkLike(Protocol):
    """Told how far an upload has been written while it streams (``quantd.server.uploads.FileSink``)."""

    def advance(self, nbytes: int) -> None: ...
    def complete(self) -> None: ...
    def abort(self) -> None: ...


class ArtifactStore(Protocol):
    """The file side of the job layer. An object-store backend implements the same calls."""

    def init(self) -> None: ...
    @property
    def tmp(self) -> Path: ...
    def new_tmp_path(self, suffix: str = "", *, prefix: str = "upload") -> Path: ...
    def adopt_upload(self, src: Path, job_id: str, kind: UploadKind) -> Path | None: ...
    def discard(self, path: Path) -> None: ...
    def upload_path(self, job_id: str, kind: UploadKind) -> Path: ...
    def artifact_tmp_path(self, job_id: str) -> Path: ...
    def commit_artifact(self, tmp: Path, job_id: str) -> StoredArtifact: ...
    def seal_artifact(self, tmp: Path) -> tuple[str, int]: ...
    def install_artifact(self, tmp: Path, job_id: str) -> Path | None: ...
    def artifact_path(self, job_id: str) -> Path: ...
    def put_report(self, job_id: str, report_json: str) -> None: ...
    def stage_report(self, job_id: str, report_json: str) -> Path: ...
    def install_report(self, tmp: Path, job_id: str) -> None: ...
    def get_report(self, job_id: str) -> str | None: ...
    def delete_job_files(self, job_id: str) -> None: ...
    def writable(self) -> bool: ...
    def sweep_tmp(self, older_than_s: float) -> int: ...
    def release_scratch(self) -> None: ...
    def list_upload_ids(self, older_than_s: float) -> list[str]: ...
    # Streams and ranges, for stores whose files are not local paths (quantd.jobs.backends.s3):
    def stage_upload(self, job_id: str, kind: UploadKind) -> Path | None: ...
    def unstage(self, path: Path) -> None: ...
    def local_artifact(self, job_id: str) -> Path | None: ...
    def artifact_info(self, job_id: str) -> int | None: ...
    def read_artifact(self, job_id: str, start: int, length: int) -> Iterator[bytes]: ...
    def artifact_url(self, job_id: str, filename: str) -> str | None: ...
    def stream_upload(self, path: Path, job_id: str, kind: UploadKind) -> FileSinkLike | None: ...


class LocalStorage:
    """Files on the local disk under ``data_dir``; renames are atomic within one filesystem."""

    def __init__(self, data_dir: Path) -> None:
        self.root = Path(data_dir).resolve()
        self.uploads = self.root / "uploads"
        self.artifacts = self.root / "artifacts"
        self.reports = self.root / "reports"
        self.tmp_root = self.root / "tmp"

    @property
    def tmp(self) -> Path:
        """This process's scratch folder, ``tmp/p-<id>/`` (:mod:`quantd.jobs.scratch`)."""
        return scratch.process_dir(self.tmp_root)

    def init(self) -> None:
        for d in (self.uploads, self.artifacts, self.reports, self.tmp_root):
            d.mkdir(parents=True, exist_ok=True)
        scratch.remove_dead(self.tmp_root)  # what processes killed on this data dir left

    def inside(self, path: Path) -> Path:
        """``path`` resolved, or StorageError when it resolves outside ``data_dir``."""
        resolved = Path(path).resolve()
        if not resolved.is_relative_to(self.root):
            raise StorageError(f"path {str(path)!r} is outside the data dir", field="path")
        return resolved

    def _job_file(self, folder: Path, job_id: str, suffix: str) -> Path:
        if not is_job_id(job_id):
            raise StorageError(f"{job_id!r} is not a job id", field="job_id")
        return self.inside(folder / f"{job_id}{suffix}")

    def new_tmp_path(self, suffix: str = "", *, prefix: str = "upload") -> Path:
        """A fresh path in ``tmp/`` for the server to stream an upload (or write a run's artifact) into."""
        if not re.fullmatch(r"(\.[A-Za-z0-9]{1,16})?", suffix):
            raise StorageError(f"suffix {suffix!r} is not an extension", field="suffix")
        if not re.fullmatch(r"[a-z]{1,16}", prefix):
            raise StorageError(f"prefix {prefix!r} is not a short lowercase word", field="prefix")
        return self.inside(self.tmp / f"{prefix}-{uuid.uuid4().hex}{suffix}")

    def adopt_upload(self, src: Path, job_id: str, kind: UploadKind) -> Path:
        """Move an upload in place, durably: its bytes and its new name are on disk when this returns
        (the job row that points at it is committed with ``synchronous = FULL`` right after)."""
        src = self.inside(src)
        with open(src, "rb") as f:  # the upload streamed its writeback early: little is left to flush
            os.fsync(f.fileno())
        dst = self.upload_path(job_id, kind)
        os.replace(src, dst)
        fsync_dir(dst.parent)
        return dst

    def discard(self, path: Path) -> None:
        """Delete a leftover upload; a path outside ``data_dir`` is never touched."""
        resolved = Path(path).resolve()
        if resolved.is_relative_to(self.root):
            resolved.unlink(missing_ok=True)

    def upload_path(self, job_id: str, kind: UploadKind) -> Path:
        return self._job_file(self.uploads, job_id, f".{kind}")

    def artifact_tmp_path(self, job_id: str) -> Path:
        if not is_job_id(job_id):
            raise StorageError(f"{job_id!r} is not a job id", field="job_id")
        # Unique per attempt: a worker whose lease was lost never writes into another's file.
        return self.inside(self.tmp / f"artifact-{job_id}-{uuid.uuid4().hex[:12]}.part")

    def commit_artifact(self, tmp: Path, job_id: str) -> StoredArtifact:
        sha256, size = self.seal_artifact(tmp)
        return StoredArtifact(path=self.install_artifact(tmp, job_id), bytes=size, sha256=sha256)

    def seal_artifact(self, tmp: Path) -> tuple[str, int]:
        """A finished artifact's temporary file on disk (fsync), its sha256 and size."""
        tmp = self.inside(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        return sha256_file(tmp), tmp.stat().st_size

    def install_artifact(self, tmp: Path, job_id: str) -> Path:
        """Move a sealed artifact to the job's artifact path (atomically, replacing any)."""
        dst = self.artifact_path(job_id)
        os.replace(self.inside(tmp), dst)
        fsync_dir(dst.parent)
        return dst

    def artifact_path(self, job_id: str) -> Path:
        return self._job_file(self.artifacts, job_id, ".safetensors")

    def put_report(self, job_id: str, report_json: str) -> None:
        self.install_report(self.stage_report(job_id, report_json), job_id)

    def stage_report(self, job_id: str, report_json: str) -> Path:
        """The report written (fsync) to a temporary file of its own, for :meth:`install_report`."""
        self._job_file(self.reports, job_id, ".json")  # a job id, not a path
        tmp = self.inside(self.tmp / f"report-{job_id}-{uuid.uuid4().hex[:12]}.part")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(report_json)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def install_report(self, tmp: Path, job_id: str) -> None:
        dst = self._job_file(self.reports, job_id, ".json")
        os.replace(self.inside(tmp), dst)
        fsync_dir(dst.parent)

    def get_report(self, job_id: str) -> str | None:
        try:
            return self._job_file(self.reports, job_id, ".json").read_text(encoding="utf-8")
        except FileNotFoundError:
            return None

    def delete_job_files(self, job_id: str) -> None:
        """The job's upload, artifact and report, and the drafts of its attempts in tmp/ (a dead attempt's
        partial artifact stayed there until the 24 h sweep; an attempt still writing one fails to seal it,
        and its worker lives on)."""
        for path in (self.upload_path(job_id, "input"), self.upload_path(job_id, "calibration"),
                     self.artifact_path(job_id), self._job_file(self.reports, job_id, ".json")):
            path.unlink(missing_ok=True)  # (upload_path checked that job_id is a job id: safe in a glob)
        for pattern in (f"artifact-{job_id}-*.part*", f"report-{job_id}-*.part*"):  # .part.tmp: still being written
            for draft in scratch.glob_all(self.tmp_root, pattern):
                draft.unlink(missing_ok=True)

    def writable(self) -> bool:
        probe = self.tmp / f"probe-{uuid.uuid4().hex}"
        try:
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError:
            return False
        return True

    def release_scratch(self) -> None:
        """This process's scratch folder removed if empty (a clean stop)."""
        scratch.release(self.tmp_root)

    def sweep_tmp(self, older_than_s: float) -> int:
        """Delete the scratch folders of ended processes at once, and leftovers older than ``older_than_s``
        (uploads never submitted, a failed cleanup) in this process's folder and loose in ``tmp/``."""
        scratch.touch_mine(self.tmp_root)
        cutoff, n = time.time() - older_than_s, scratch.remove_dead(self.tmp_root, older_than_s=older_than_s)
        for path in (*self.tmp_root.iterdir(), *self.tmp.iterdir()):
            if path.parent == self.tmp_root and scratch.is_process_entry(path):
                continue  # a process's folder and lock: removed above once its process has ended, never by age
            try:
                if path.is_file() and path.stat().st_mtime < cutoff:
                    path.unlink()
                    n += 1
                elif path.is_dir() and path.stat().st_mtime < cutoff:  # a dead directory job's work
                    shutil.rmtree(path, ignore_errors=True)
                    n += 1
            except FileNotFoundError:
                continue
        return n

    def list_upload_ids(self, older_than_s: float) -> list[str]:
        """Job ids of uploads older than ``older_than_s`` (to find those no job row owns)."""
        cutoff, ids = time.time() - older_than_s, set()
        for path in self.uploads.iterdir():
            try:
                if is_job_id(path.stem) and path.stat().st_mtime < cutoff:
                    ids.add(path.stem)
            except FileNotFoundError:
                continue
        return sorted(ids)

    # -- streams and ranges (the object-store side of the protocol) ------------------------------
    def stage_upload(self, job_id: str, kind: UploadKind) -> Path | None:
        """The upload itself (already local), or None when it is gone."""
        path = self.upload_path(job_id, kind)
        return path if path.is_file() else None

    def unstage(self, path: Path) -> None:
        """Nothing to do: :meth:`stage_upload` made no copy."""

    def local_artifact(self, job_id: str) -> Path | None:
        path = self.artifact_path(job_id)
        return path if path.is_file() else None

    def artifact_info(self, job_id: str) -> int | None:
        try:
            return self.artifact_path(job_id).stat().st_size
        except FileNotFoundError:
            return None

    def read_artifact(self, job_id: str, start: int, length: int) -> Iterator[bytes]:
        with open(self.artifact_path(job_id), "rb") as f:
            f.seek(start)
            while length > 0 and (chunk := f.read(min(_CHUNK, length))):
                length -= len(chunk)
                yield chunk

    def artifact_url(self, job_id: str, filename: str) -> str | None:
        return None

    def stream_upload(self, path: Path, job_id: str, kind: UploadKind) -> FileSinkLike | None:
        """None: an upload is stored where it is written (see :meth:`adopt_upload`)."""
        return None
