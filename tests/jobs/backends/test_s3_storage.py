"""The S3 file store against a real S3 endpoint (moto's server): multipart transfers, staging, byte ranges,
presigned URLs, deletion, and the sweep of orphans and unfinished multipart uploads."""

from __future__ import annotations

import hashlib
import os
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from quantd.jobs.backends.s3 import PART_BYTES, S3Storage, parse_s3_url
from quantd.jobs.errors import StorageError

ID = uuid.uuid4().hex


@pytest.fixture
def storage(s3: Any, bucket: str, tmp_path: Path) -> S3Storage:
    st = S3Storage(f"s3://{bucket}/q/jobs", tmp_path / "scratch", endpoint_url=s3.endpoint)
    st.init()
    return st


def write(path: Path, n: int) -> bytes:
    data = os.urandom(n)
    path.write_bytes(data)
    return data


def test_urls_are_parsed_strictly() -> None:
    assert parse_s3_url("s3://bkt/a/b/").key == "a/b/"
    assert parse_s3_url("s3://bkt").key == ""
    for bad in ("http://bkt/a", "s3://B_k/a", "s3://bkt/a/../b", "s3://bkt/a//b", "s3://bkt/./a", "s3://bkt/a\\b",
                "s3://bkt/a\nb", "file:///etc/passwd", "s3:/bkt/a"):
        with pytest.raises(StorageError):
            parse_s3_url(bad)


def test_an_unreachable_bucket_fails_at_start(s3: Any, tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="not reachable"):
        S3Storage("s3://no-such-bucket-here/x", tmp_path, endpoint_url=s3.endpoint).init()


def test_upload_stage_artifact_report_delete(storage: S3Storage) -> None:
    src = storage.new_tmp_path(".safetensors")
    data = write(src, 2 * PART_BYTES + 123)  # a multipart upload of three parts
    assert storage.adopt_upload(src, ID, "input") is None
    assert not src.exists()  # scratch freed once the object is stored
    assert storage.list_keys() == [f"q/jobs/uploads/{ID}.input"]

    staged = storage.stage_upload(ID, "input")
    assert staged is not None and staged.read_bytes() == data
    storage.unstage(staged)
    assert not staged.exists()
    assert storage.stage_upload(ID, "calibration") is None  # none was uploaded

    tmp = storage.artifact_tmp_path(ID)
    art = write(tmp, 5000)
    sha, size = storage.seal_artifact(tmp)
    assert (sha, size) == (hashlib.sha256(art).hexdigest(), 5000)
    storage.install_artifact(tmp, ID)
    storage.install_report(storage.stage_report(ID, '{"ok": 1}'), ID)
    assert storage.artifact_info(ID) == 5000 and storage.local_artifact(ID) is None
    assert b"".join(storage.read_artifact(ID, 100, 900)) == art[100:1000]
    assert b"".join(storage.read_artifact(ID, 0, 5000)) == art
    assert storage.get_report(ID) == '{"ok": 1}'
    assert storage.artifact_url(ID, "x.safetensors") is None  # presigning is off
    assert list(storage.tmp.iterdir()) == []  # nothing of the job left on scratch

    storage.delete_job_files(ID)
    assert storage.list_keys() == []
    assert storage.artifact_info(ID) is None and storage.get_report(ID) is None


def test_presigned_artifact_url(s3: Any, bucket: str, tmp_path: Path) -> None:
    st = S3Storage(f"s3://{bucket}", tmp_path, endpoint_url=s3.endpoint, presign=True)
    st.init()
    tmp = st.artifact_tmp_path(ID)
    art = write(tmp, 777)
    st.install_artifact(tmp, ID)
    url = st.artifact_url(ID, f"{ID}.quantd.safetensors")
    assert url is not None and url.startswith(s3.endpoint) and "Signature" in url
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.read() == art


def test_sweep_aborts_unfinished_multipart_uploads_and_finds_orphans(storage: S3Storage) -> None:
    c = storage.client
    up = c.create_multipart_upload(Bucket=storage.bucket, Key=f"q/jobs/uploads/{ID}.input")
    c.upload_part(Bucket=storage.bucket, Key=f"q/jobs/uploads/{ID}.input", UploadId=up["UploadId"], PartNumber=1,
                  Body=b"x" * 100)
    src = storage.new_tmp_path()
    write(src, 10)
    other = uuid.uuid4().hex
    storage.adopt_upload(src, other, "input")
    assert storage.list_upload_ids(3600) == []  # too young to be an orphan
    time.sleep(1.1)
    assert storage.list_upload_ids(1.0) == []  # listed a moment ago: not again before LIST_INTERVAL_S
    storage._listed.clear()
    assert storage.list_upload_ids(1.0) == [other]
    # (moto's server reports every multipart upload as initiated in 2010: only the abort is checked here.)
    assert storage.sweep_tmp(1.0) == 1
    assert c.list_multipart_uploads(Bucket=storage.bucket).get("Uploads", []) == []


def test_keys_are_built_from_job_ids_only(storage: S3Storage) -> None:
    for bad in ("../x", "a" * 31, ID.upper(), ID + "/"):
        with pytest.raises(StorageError):
            storage.artifact_key(bad)
        with pytest.raises(StorageError):
            storage.stage_upload(bad, "input")


def test_an_upload_streams_to_the_bucket_while_it_is_written(storage: S3Storage) -> None:
    """Parts go out as the file grows (before it is complete); adopt finds the object in place."""
    path = storage.new_tmp_path()
    chunk = os.urandom(PART_BYTES // 2)
    written = 0
    with open(path, "wb") as f:  # created before its sink, as the upload parser does
        sink = storage.stream_upload(path, ID, "input")
        for i in range(5):  # 2.5 parts
            f.write(chunk)
            f.flush()
            written += len(chunk)
            sink.advance(written)
            if i == 3:  # two whole parts written: the first is in flight or sent, nothing is complete yet
                uploads = wait_for_upload(storage)
                assert uploads and uploads[0]["Key"] == f"q/jobs/uploads/{ID}.input"
                assert storage.list_keys() == []
    sink.complete()
    storage.adopt_upload(path, ID, "input")
    assert not path.exists()
    staged = storage.stage_upload(ID, "input")
    assert staged is not None and staged.read_bytes() == chunk * 5
    assert storage.client.list_multipart_uploads(Bucket=storage.bucket).get("Uploads", []) == []


def wait_for_upload(storage: S3Storage) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 30
    while not (ups := storage.client.list_multipart_uploads(Bucket=storage.bucket).get("Uploads", [])):
        assert time.monotonic() < deadline, "no multipart upload began"
        time.sleep(0.02)
    return list(ups)


def test_a_file_ending_on_a_part_boundary_and_an_empty_file(storage: S3Storage) -> None:
    """Two whole parts, the body's end seen only after both were sent; and a zero-byte upload (one PUT)."""
    full, empty = storage.new_tmp_path(), storage.new_tmp_path()
    data = write(full, 2 * PART_BYTES)
    empty.write_bytes(b"")
    sink = storage.stream_upload(full, ID, "input")
    sink.advance(2 * PART_BYTES)
    deadline = time.monotonic() + 30
    while sink._sent < 2 * PART_BYTES:  # both parts out before the end is known
        assert time.monotonic() < deadline
        time.sleep(0.02)
    sink.complete()
    storage.adopt_upload(full, ID, "input")
    other = uuid.uuid4().hex
    empty_sink = storage.stream_upload(empty, other, "input")
    empty_sink.complete()
    storage.adopt_upload(empty, other, "input")
    assert b"".join(storage.read_range(storage.bucket, storage.upload_key(ID, "input"), 0, len(data))) == data
    meta = storage.head(storage.bucket, storage.upload_key(other, "input"))
    assert meta is not None and meta["ContentLength"] == 0
    assert storage.client.list_multipart_uploads(Bucket=storage.bucket).get("Uploads", []) == []


def test_a_streamed_upload_no_job_takes_is_removed(storage: S3Storage) -> None:
    small, big = storage.new_tmp_path(), storage.new_tmp_path()
    other = uuid.uuid4().hex
    write(small, 1000)
    data = write(big, PART_BYTES + 10)
    for path, job_id in ((small, ID), (big, other)):
        sink = storage.stream_upload(path, job_id, "input")
        sink.advance(path.stat().st_size)
        sink.complete()
        assert sink.wait(30)
    assert sorted(storage.list_keys()) == sorted([f"q/jobs/uploads/{ID}.input", f"q/jobs/uploads/{other}.input"])
    assert b"".join(storage.read_range(storage.bucket, f"q/jobs/uploads/{other}.input", 0, len(data))) == data
    storage.discard(small)  # e.g. the upload failed its checks, or an idempotent replay
    storage.discard(big)
    assert storage.list_keys() == [] and not small.exists() and not big.exists()


def test_an_aborted_stream_leaves_nothing(storage: S3Storage) -> None:
    path = storage.new_tmp_path()
    write(path, 2 * PART_BYTES)
    sink = storage.stream_upload(path, ID, "input")
    sink.advance(2 * PART_BYTES)  # two parts' worth, the body not complete
    wait_for_upload(storage)
    sink.abort()  # the client went away
    assert not sink.wait(30)
    assert storage.client.list_multipart_uploads(Bucket=storage.bucket).get("Uploads", []) == []
    assert storage.list_keys() == []
