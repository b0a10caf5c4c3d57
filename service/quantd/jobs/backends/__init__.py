"""Backends chosen by URL: the job store from ``QUANTD_DATABASE_URL`` and the file store from
``QUANTD_STORAGE_URL``, one module per backend, each registered here by its URL scheme.

- ``sqlite:///PATH`` (default: ``data_dir/quantd.db``): :class:`quantd.jobs.store.SQLiteJobStore`, one host.
- ``postgresql://...``: :class:`quantd.jobs.backends.postgres.PostgresJobStore`, any number of hosts.
- ``file:///PATH`` (default: ``data_dir``): :class:`quantd.jobs.storage.LocalStorage`, one host (or a shared
  POSIX filesystem).
- ``s3://bucket/prefix``: :class:`quantd.jobs.backends.s3.S3Storage`, any number of hosts; the data dir is
  each process's local scratch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import StorageError
from ..storage import ArtifactStore, LocalStorage
from ..store import JobStore, SQLiteJobStore

if TYPE_CHECKING:
    from ..config import JobsConfig

JobStoreFactory = Callable[[str, "JobsConfig"], JobStore]
FileStoreFactory = Callable[[str, "JobsConfig"], ArtifactStore]
JOB_STORES: dict[str, JobStoreFactory] = {}
FILE_STORES: dict[str, FileStoreFactory] = {}


def job_store(*schemes: str) -> Callable[[JobStoreFactory], JobStoreFactory]:
    def register(factory: JobStoreFactory) -> JobStoreFactory:
        for scheme in schemes:
            JOB_STORES[scheme] = factory
        return factory
    return register


def file_store(*schemes: str) -> Callable[[FileStoreFactory], FileStoreFactory]:
    def register(factory: FileStoreFactory) -> FileStoreFactory:
        for scheme in schemes:
            FILE_STORES[scheme] = factory
        return factory
    return register


def _scheme(url: str, known: Mapping[str, object], setting: str) -> str:
    scheme, sep, _ = url.partition("://")
    if not sep or scheme not in known:
        raise StorageError(f"{setting}: {url.split('@')[-1][:120]!r} is not one of "
                           f"{sorted(s + '://...' for s in known)}", field=setting.lower())
    return scheme


def _local_path(url: str) -> Path:
    """``sqlite:///data/quantd.db`` / ``file:///data`` → ``/data/quantd.db`` / ``/data``."""
    path = url.partition("://")[2]
    if not path:
        raise StorageError(f"{url!r} names no path", field="url")
    return Path(path)


@job_store("sqlite")
def _sqlite(url: str, config: JobsConfig) -> JobStore:
    path = _local_path(url)
    path.parent.mkdir(parents=True, exist_ok=True)
    return SQLiteJobStore(path)


@job_store("postgresql", "postgres")
def _postgres(url: str, config: JobsConfig) -> JobStore:
    from .postgres import PostgresJobStore

    return PostgresJobStore(url, migrate=config.migrate)


@file_store("file")
def _file(url: str, config: JobsConfig) -> ArtifactStore:
    return LocalStorage(_local_path(url))


@file_store("s3")
def _s3(url: str, config: JobsConfig) -> ArtifactStore:
    from .s3 import S3Storage

    return S3Storage(url, config.data_dir, endpoint_url=config.s3_endpoint_url, presign=config.storage_presign)


def database_url(config: JobsConfig) -> str:
    return config.database_url or f"sqlite://{(Path(config.data_dir).resolve() / 'quantd.db').as_posix()}"


def storage_url(config: JobsConfig) -> str:
    return config.storage_url or f"file://{Path(config.data_dir).resolve().as_posix()}"


def open_job_store(config: JobsConfig) -> JobStore:
    url = database_url(config)
    store = JOB_STORES[_scheme(url, JOB_STORES, "QUANTD_DATABASE_URL")](url, config)
    store.init()
    return store


def open_file_store(config: JobsConfig) -> ArtifactStore:
    url = storage_url(config)
    storage = FILE_STORES[_scheme(url, FILE_STORES, "QUANTD_STORAGE_URL")](url, config)
    storage.init()
    return storage


def open_backends(config: JobsConfig) -> tuple[JobStore, ArtifactStore]:
    """The job store and file store the config's URLs name (SQLite and files under ``data_dir`` by default),
    initialised: the schema migrated (PostgreSQL: unless ``migrate`` is off), directories made, the
    bucket reached."""
    storage = open_file_store(config)
    return open_job_store(config), storage


def upgrade_database(config: JobsConfig) -> tuple[str, list[int]]:
    """``quantd db upgrade``: the migrations applied to the configured database (its URL without password)."""
    url = database_url(config)
    scheme = _scheme(url, JOB_STORES, "QUANTD_DATABASE_URL")
    shown = scheme + "://" + url.partition("://")[2].rpartition("@")[2]
    if scheme == "sqlite":
        store = JOB_STORES[scheme](url, config)
        store.init()  # SQLite's schema is created in place at start; its version is PRAGMA user_version
        store.close()
        return shown, []
    from .postgres import upgrade

    return shown, upgrade(url)
