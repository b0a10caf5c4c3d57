"""quantd.jobs: the durable job layer under the HTTP server.

The server uses ``JobService`` (see docs/architecture.md, "jobs API"), as specified there, with:
- ``submit(..., calibration=None, idempotency_key=None)`` takes ownership of the upload files (moved
  under ``uploads/`` or deleted). Stream uploads into ``new_upload_path(suffix)`` (the storage's scratch folder, ``upload_dir``).
- ``start()``/``stop()`` are async (``start_sync``/``stop_sync`` too). Sync, blocking (call from a
  thread): ``ready() -> {"database": bool, "storage": bool, "workers": int}``, ``live_workers() -> int``,
  ``busy_workers() -> int`` (workers of every process on the DB), ``queue_depth()``, ``counts_by_status()``.
- ``cancel`` of a running job returns it still ``running`` (cancel asked); of a finished job, deletes its
  files. ``report``/``artifact_path`` raise JobNotReady (409) until succeeded, JobExpired (410) once the
  files were deleted (TTL or DELETE). Errors: quantd.jobs.errors (JobNotFound 404, JobNotReady 409,
  JobExpired 410, IdempotencyConflict 409, QueueFull 429 with ``retry_after``, InvalidListQuery 422).
- ``events`` raises JobNotFound on its first step: call ``get`` first to answer 404 before streaming.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import JobsConfig, worker_devices
    from .errors import (
        IdempotencyConflict,
        InvalidListQuery,
        JobExpired,
        JobNotFound,
        JobNotReady,
        QueueFull,
        StorageError,
    )
    from .pool import WorkerPool, open_backends, run_worker
    from .records import JobRecord
    from .service import JobService, decode_cursor, encode_cursor
    from .storage import ArtifactStore, LocalStorage, StoredArtifact, StoredUpload
    from .store import JobStore, SQLiteJobStore
    from .worker import QuantizeFn

# Where each public name lives. The names load on first use (PEP 562), so that importing one module of the
# layer (``quantd.jobs.config`` for the CLI's device check) does not import the store, the pool and the
# service with it.
_HOMES = {
    "JobsConfig": "config", "worker_devices": "config",
    "IdempotencyConflict": "errors", "InvalidListQuery": "errors", "JobExpired": "errors", "JobNotFound": "errors",
    "JobNotReady": "errors", "QueueFull": "errors", "StorageError": "errors",
    "WorkerPool": "pool", "open_backends": "pool", "run_worker": "pool",
    "JobRecord": "records",
    "JobService": "service", "decode_cursor": "service", "encode_cursor": "service",
    "ArtifactStore": "storage", "LocalStorage": "storage", "StoredArtifact": "storage", "StoredUpload": "storage",
    "JobStore": "store", "SQLiteJobStore": "store",
    "QuantizeFn": "worker",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "ArtifactStore",
    "IdempotencyConflict",
    "InvalidListQuery",
    "JobExpired",
    "JobNotFound",
    "JobNotReady",
    "JobRecord",
    "JobService",
    "JobStore",
    "JobsConfig",
    "LocalStorage",
    "QuantizeFn",
    "QueueFull",
    "SQLiteJobStore",
    "StorageError",
    "StoredArtifact",
    "StoredUpload",
    "WorkerPool",
    "decode_cursor",
    "encode_cursor",
    "open_backends",
    "run_worker",
    "worker_devices",
]
