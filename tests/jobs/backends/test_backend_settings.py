"""Backends chosen by URL: the settings that name them, checked at start, and the registry that opens them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from pydantic import ValidationError

from quantd.jobs import JobsConfig, LocalStorage, SQLiteJobStore
from quantd.jobs.backends import FILE_STORES, JOB_STORES, database_url, open_backends, storage_url
from quantd.jobs.errors import StorageError
from quantd.server.settings import Settings, SettingsError, parse_source_prefixes


def test_defaults_are_sqlite_and_files_under_the_data_dir(tmp_path: Path) -> None:
    config = JobsConfig(data_dir=tmp_path / "d")
    assert database_url(config) == f"sqlite://{(tmp_path / 'd' / 'quantd.db').resolve().as_posix()}"
    assert storage_url(config) == f"file://{(tmp_path / 'd').resolve().as_posix()}"
    store, storage = open_backends(config)
    assert isinstance(store, SQLiteJobStore) and isinstance(storage, LocalStorage)
    assert (tmp_path / "d" / "quantd.db").is_file()
    store.close()


def test_urls_name_other_places(tmp_path: Path) -> None:
    config = JobsConfig(data_dir=tmp_path / "scratch", database_url=f"sqlite://{tmp_path}/db/jobs.db",
                        storage_url=f"file://{tmp_path}/files")
    store, storage = open_backends(config)
    assert isinstance(storage, LocalStorage) and storage.root == (tmp_path / "files").resolve()
    assert (tmp_path / "db" / "jobs.db").is_file()
    store.close()
    with pytest.raises(StorageError, match="QUANTD_DATABASE_URL"):
        open_backends(JobsConfig(data_dir=tmp_path, database_url="mysql://u:secret@h/db"))
    with pytest.raises(StorageError, match="QUANTD_STORAGE_URL"):
        open_backends(JobsConfig(data_dir=tmp_path, storage_url="gs://bucket/x"))


def test_every_backend_is_registered_once_by_its_scheme() -> None:
    assert sorted(JOB_STORES) == ["postgres", "postgresql", "sqlite"]
    assert sorted(FILE_STORES) == ["file", "s3"]


def test_settings_refuse_unknown_schemes_and_bad_prefixes(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="database_url must start with"):
        Settings(data_dir=tmp_path, database_url="mysql://x/y")
    with pytest.raises(ValidationError, match="storage_url must start with"):
        Settings(data_dir=tmp_path, storage_url="/var/lib/quantd")
    s = Settings(data_dir=tmp_path, database_url="postgresql://u:pw@db/q", storage_url="s3://b/p",
                 source_prefixes="a=s3://models/a/, *=s3://models/shared/")
    assert "pw" not in repr(s)  # the database URL is a secret: never in a repr or a log line
    assert parse_source_prefixes(s.source_prefixes or "") == (("a", "s3://models/a/"), ("*", "s3://models/shared/"))
    for bad in ("s3://models/a/", "a=s3://models/a", "a=https://x/y/", "a=s3://models/../b/", "-x=s3://m/a/"):
        with pytest.raises(SettingsError):
            parse_source_prefixes(bad)


def test_a_missing_driver_is_named_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "psycopg" else real(name, *a))
    with pytest.raises(ValidationError, match=r"need psycopg: pip install 'quantd\[scale\]'"):
        Settings(data_dir=tmp_path, database_url="postgresql://db/q")
