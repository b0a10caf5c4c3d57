"""Paths are built from job ids only and never leave the data dir."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from jobs_support import CONFIG, make_upload, wait_for

from quantd.io.files import sha256_file
from quantd.jobs import JobService, LocalStorage, StorageError, StoredUpload

ID = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def storage(tmp_path: Path) -> LocalStorage:
    s = LocalStorage(tmp_path / "data")
    s.init()
    return s


@pytest.mark.parametrize("job_id", ["../x", "..", "/etc/passwd", ID + "/../../x", ID.upper(), ID[:-1], ""])
def test_job_ids_only(storage: LocalStorage, job_id: str) -> None:
    for call in (lambda: storage.upload_path(job_id, "input"), lambda: storage.artifact_path(job_id),
                 lambda: storage.artifact_tmp_path(job_id), lambda: storage.put_report(job_id, "{}"),
                 lambda: storage.delete_job_files(job_id)):
        with pytest.raises(StorageError):
            call()


def test_paths_inside_data_dir(storage: LocalStorage, tmp_path: Path) -> None:
    for p in (storage.upload_path(ID, "input"), storage.artifact_path(ID), storage.artifact_tmp_path(ID),
              storage.new_tmp_path(".safetensors")):
        assert (p.is_relative_to(storage.root) and ID in p.name) or p.parent == storage.tmp
    outside = tmp_path / "secret"
    outside.write_bytes(b"x")
    with pytest.raises(StorageError):
        storage.adopt_upload(outside, ID, "input")
    assert outside.exists()
    with pytest.raises(StorageError):
        storage.adopt_upload(storage.tmp_root / ".." / ".." / "secret", ID, "input")
    (storage.tmp / "link").symlink_to(outside)
    with pytest.raises(StorageError):
        storage.adopt_upload(storage.tmp / "link", ID, "input")
    for suffix in ("/../../x", ".a/b", "..", ".tar.gz/"):
        with pytest.raises(StorageError):
            storage.new_tmp_path(suffix)


def test_report_and_artifact_written_atomically(storage: LocalStorage) -> None:
    storage.put_report(ID, '{"a": 1}')
    assert storage.get_report(ID) == '{"a": 1}'
    tmp = storage.artifact_tmp_path(ID)
    tmp.write_bytes(b"abc")
    art = storage.commit_artifact(tmp, ID)
    assert not tmp.exists() and art.path == storage.artifact_path(ID) and art.bytes == 3
    assert art.sha256 == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert list(storage.tmp.iterdir()) == []
    storage.delete_job_files(ID)
    assert storage.get_report(ID) is None and not art.path.exists()


def test_sweeps(storage: LocalStorage) -> None:
    old, new = storage.new_tmp_path(), storage.new_tmp_path()
    old.write_bytes(b"o")
    new.write_bytes(b"n")
    os.utime(old, (0, 0))
    assert storage.sweep_tmp(3600) == 1 and not old.exists() and new.exists()
    up = storage.upload_path(ID, "input")
    up.write_bytes(b"u")
    assert storage.list_upload_ids(3600) == []
    os.utime(up, (0, 0))
    assert storage.list_upload_ids(3600) == [ID]


async def test_client_filename_names_no_file(make_service: Callable[..., JobService], model_file: Path,
                                             tmp_path: Path) -> None:
    svc = make_service()
    upload = make_upload(svc, model_file, filename="../../../evil name.safetensors")
    job = await svc.submit(tenant="a", upload=upload, config=CONFIG)
    await asyncio.to_thread(wait_for, lambda: svc.store.get(job.id).status == "succeeded", what="success")
    assert (await svc.get("a", job.id)).input.filename == "../../../evil name.safetensors"
    data_dir = svc.config.data_dir.resolve()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert all(p.resolve().is_relative_to(data_dir) for p in files)
    # the database, and the lock file of this process's scratch folder
    job_files = [p for p in files if not p.name.startswith("quantd.db") and p.suffix != ".lock"]
    assert sorted(p.relative_to(data_dir).as_posix() for p in job_files) == sorted(
        [f"uploads/{job.id}.input", f"artifacts/{job.id}.safetensors", f"reports/{job.id}.json"])


async def test_submit_refuses_an_upload_outside_the_data_dir(make_service: Callable[..., JobService],
                                                             model_file: Path) -> None:
    svc = make_service(workers=0)
    bad = StoredUpload(path=model_file, filename="m.safetensors", bytes=model_file.stat().st_size,
                       sha256=sha256_file(model_file), format="safetensors", tensors=3)
    with pytest.raises(StorageError):
        await svc.submit(tenant="a", upload=bad, config=CONFIG)
    assert svc.counts_by_status()["queued"] == 0
    assert list(svc.storage.uploads.iterdir()) == []
    assert model_file.is_file()  # never deleted: it is not ours


def test_adopted_uploads_and_artifacts_are_made_durable(storage: LocalStorage,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else str(fd))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    src = storage.new_tmp_path(".upload")
    src.write_bytes(b"weights")
    dst = storage.adopt_upload(src, ID, "input")
    assert dst.read_bytes() == b"weights"
    if os.path.exists("/proc/self/fd"):  # the bytes (under their temporary name), then the directory's entry
        assert synced == [str(src), str(storage.uploads)]
    synced.clear()
    tmp = storage.artifact_tmp_path(ID)
    tmp.write_bytes(b"artifact")
    storage.commit_artifact(tmp, ID)
    if os.path.exists("/proc/self/fd"):
        assert synced == [str(tmp), str(storage.artifacts)]


def test_start_writeback_is_a_harmless_hint(tmp_path: Path) -> None:
    from quantd.io.files import start_writeback

    p = tmp_path / "f"
    with open(p, "wb") as f:
        f.write(b"x" * 100_000)
        f.flush()
        start_writeback(f.fileno(), 0, 100_000)
        start_writeback(f.fileno(), 50_000, 10**12)  # past the end: still fine
    assert p.stat().st_size == 100_000


def test_deleting_a_jobs_files_takes_its_attempts_drafts(storage: LocalStorage) -> None:
    # A dead attempt's partial artifact stayed in tmp/ until the 24 h sweep, after its job had ended.
    draft = storage.artifact_tmp_path(ID)
    draft.write_bytes(b"partial")
    writing = storage.artifact_tmp_path(ID).with_suffix(".part.tmp")  # a writer's own draft, cut off mid-write
    writing.write_bytes(b"half")
    report = storage.stage_report(ID, "{}")
    other = storage.artifact_tmp_path("f" * 32)
    other.write_bytes(b"another job's")
    storage.delete_job_files(ID)
    assert not draft.exists() and not writing.exists() and not report.exists() and other.exists()
