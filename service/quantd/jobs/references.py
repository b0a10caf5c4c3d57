"""Jobs that name their data instead of uploading it: ``source`` (an ``s3://`` model file, or a model directory:
a prefix ending in ``/``) and ``destination`` (where the artifact, or every file of a directory output, is
written too).

Only ``s3://`` URLs are ever read or written, through the configured S3 endpoint: no other scheme, and no
host taken from the request, so a job cannot make the service fetch anything else (no SSRF). A URL is
allowed when it starts with one of the tenant's prefixes in ``QUANTD_SOURCE_PREFIXES`` (prefixes end in
``/``; keys with ``.``/``..``/empty segments are refused before the check); anything else is 403 and is
never fetched, not even with a HEAD. The service never deletes a source or a destination: DELETE and the
TTL remove the job's own copies only.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantd.errors import InputTooLargeError

from .backends.s3 import (
    PART_BYTES,
    READ_CHUNK,
    S3Location,
    S3Storage,
    make_client,
    parse_s3_url,
    transfer_config,
)
from .errors import SourceForbidden, SourceInvalid

MAX_SOURCE_FILES = 4096  # objects under a directory source (a model directory has tens)
HEAD_BYTES = 64 * 1024  # what is read of a source before the job is accepted (format, header); more on demand
MAX_HEADER_BYTES = 100 * 1024 * 1024


def allowed_prefixes(rules: tuple[tuple[str, str], ...], tenant: str) -> list[str]:
    return [prefix for who, prefix in rules if who in (tenant, "*")]


def check_access(rules: tuple[tuple[str, str], ...], tenant: str, url: str, *, field: str) -> S3Location:
    """The location of ``url`` when ``tenant`` may read or write it; SourceForbidden (403) otherwise."""
    prefixes = allowed_prefixes(rules, tenant)
    what = f"{field} {url[:200]!r}"
    if not url.startswith("s3://"):
        raise SourceForbidden(f"{what}: only s3:// URLs under this tenant's allowed prefixes are read or "
                              "written", field=field)
    try:
        loc = parse_s3_url(url, field=field)
    except Exception as e:
        raise SourceForbidden(f"{what}: {getattr(e, 'detail', e)}", field=field) from None
    if not any(loc.url.startswith(p) for p in prefixes):
        hint = "no prefix is allowed for this tenant" if not prefixes else "it is not under an allowed prefix"
        raise SourceForbidden(f"{what}: {hint} (QUANTD_SOURCE_PREFIXES)", field=field)
    return loc


@dataclass(frozen=True)
class SourceObject:
    location: S3Location
    bytes: int
    etag: str


@dataclass(frozen=True)
class SourceDirectory:
    """The objects under a directory source: relative path (checked like an uploaded directory's) → object."""

    location: S3Location
    files: tuple[tuple[str, SourceObject], ...]

    @property
    def bytes(self) -> int:
        return sum(obj.bytes for _, obj in self.files)

    @property
    def etag(self) -> str:
        """One tag for the whole listing: it changes when any object, or the set of objects, does."""
        lines = "".join(f"{rel}\0{obj.etag}\n" for rel, obj in self.files)
        return hashlib.sha256(lines.encode()).hexdigest()


def is_prefix(loc: S3Location) -> bool:
    return loc.key == "" or loc.key.endswith("/")


class References:
    """Reads sources and writes destinations with one S3 client (the file store's when it is S3)."""

    def __init__(self, client: Any = None, *, endpoint_url: str | None = None) -> None:
        self._client = client
        self._endpoint_url = endpoint_url

    @classmethod
    def for_storage(cls, storage: Any, endpoint_url: str | None) -> References:
        return cls(storage.client if isinstance(storage, S3Storage) else None, endpoint_url=endpoint_url)

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = make_client(self._endpoint_url)
        return self._client

    def head(self, loc: S3Location, *, max_bytes: int) -> SourceObject:
        """The source object's size and ETag; SourceInvalid (422) for a directory prefix or a missing object,
        InputTooLargeError (413) above ``max_bytes``."""
        if loc.key == "" or loc.key.endswith("/"):
            raise SourceInvalid(f"source {loc.url!r} names a prefix: name one model file", field="source")
        try:
            meta = self.client.head_object(Bucket=loc.bucket, Key=loc.key)
        except Exception as e:
            raise SourceInvalid(f"source {loc.url!r} cannot be read: {_reason(e)}", field="source") from None
        size = int(meta["ContentLength"])
        if size > max_bytes:
            raise InputTooLargeError(f"source {loc.url!r} is {size} bytes, above the limit of {max_bytes}")
        return SourceObject(loc, size, str(meta.get("ETag", "")))

    def list_directory(self, loc: S3Location, *, max_bytes: int, max_files: int = MAX_SOURCE_FILES
                       ) -> SourceDirectory:
        """The objects under the prefix ``loc``, each relative path checked as an uploaded directory part's
        (422 naming it; zero-byte ``.../`` folder markers are skipped); 413 above ``max_files`` objects or
        ``max_bytes`` in all; SourceInvalid (422) when the prefix cannot be listed or holds nothing."""
        from quantd.io.model_dir import PathError, check_relpath

        found: list[tuple[str, SourceObject]] = []
        total = 0
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=loc.key)
            for page in pages:
                for obj in page.get("Contents", []):
                    rel, size = str(obj["Key"])[len(loc.key):], int(obj["Size"])
                    if (rel == "" or rel.endswith("/")) and size == 0:  # folder markers, the prefix's own too
                        continue
                    try:
                        check_relpath(rel)
                    except PathError as e:
                        raise PathError(f"source {loc.url!r}: {e.detail}", field="source") from None
                    total += size
                    if len(found) >= max_files:
                        raise InputTooLargeError(f"source {loc.url!r} holds more than {max_files} objects")
                    if total > max_bytes:
                        raise InputTooLargeError(f"source {loc.url!r} holds more than {max_bytes} bytes, the limit")
                    found.append((rel, SourceObject(S3Location(loc.bucket, str(obj["Key"])), size,
                                                    str(obj.get("ETag", "")))))
        except (PathError, InputTooLargeError):
            raise
        except Exception as e:
            raise SourceInvalid(f"source {loc.url!r} cannot be listed: {_reason(e)}", field="source") from None
        if not found:
            raise SourceInvalid(f"source {loc.url!r}: no objects under this prefix", field="source")
        return SourceDirectory(loc, tuple(sorted(found)))

    def sample(self, obj: SourceObject, dst: Path) -> None:
        """A sparse stand-in for the source at ``dst``: its size, with its first bytes (a safetensors file's
        whole header) and its last HEAD_BYTES (a zip's directory) in place, for the format and config checks
        the upload path runs, without reading the weights."""
        head = self._range(obj, 0, min(obj.bytes, HEAD_BYTES))
        if len(head) >= 8 and obj.bytes > 8:
            n = int.from_bytes(head[:8], "little")
            if 8 + n > len(head) and n <= min(MAX_HEADER_BYTES, obj.bytes - 8):
                head = self._range(obj, 0, 8 + n)
        tail_start = max(len(head), obj.bytes - HEAD_BYTES)
        tail = self._range(obj, tail_start, obj.bytes - tail_start)
        with open(dst, "wb") as f:
            f.truncate(obj.bytes)
            f.write(head)
            f.seek(tail_start)
            f.write(tail)

    def _range(self, obj: SourceObject, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        body = self.client.get_object(Bucket=obj.location.bucket, Key=obj.location.key, IfMatch=obj.etag,
                                       Range=f"bytes={start}-{start + length - 1}")["Body"]
        with body:
            return bytes(body.read())

    def stage(self, url: str, etag: str, dst: Path) -> None:
        """The source downloaded to ``dst`` (a worker's scratch) as a stream of ranged GETs of PART_BYTES,
        each conditional on the ETag the job was accepted with: a source replaced meanwhile fails the job
        instead of quantizing other bytes than were checked."""
        loc = parse_s3_url(url, field="source")
        try:
            with open(dst, "wb") as f:
                size = int(self.client.head_object(Bucket=loc.bucket, Key=loc.key, IfMatch=etag)["ContentLength"])
                for start in range(0, size, PART_BYTES):
                    end = min(size, start + PART_BYTES) - 1
                    body = self.client.get_object(Bucket=loc.bucket, Key=loc.key, IfMatch=etag,
                                                  Range=f"bytes={start}-{end}")["Body"]
                    with body:
                        for chunk in body.iter_chunks(READ_CHUNK):
                            f.write(chunk)
                if f.tell() != size:
                    raise OSError(f"read {f.tell()} of {size} bytes")
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(dst)
            raise

    def put(self, path: Path, url: str) -> None:
        loc = parse_s3_url(url, field="destination")
        self.client.upload_file(str(path), loc.bucket, loc.key, Config=transfer_config())

    def put_tree(self, tar: Path, prefix: str) -> None:
        """Every file of a directory output (the uncompressed tar ``tar``) written under the destination
        prefix at its relative path, each streamed from the tar as a multipart transfer."""
        import tarfile

        from quantd.io.model_dir import check_relpath

        with tarfile.open(tar, mode="r:") as archive:
            for member in archive:
                if not member.isfile():
                    continue
                loc = parse_s3_url(prefix + check_relpath(member.name), field="destination")
                fobj = archive.extractfile(member)
                if fobj is None:
                    raise OSError(f"{member.name!r} cannot be read from the output")
                with fobj:
                    self.client.upload_fileobj(fobj, loc.bucket, loc.key, Config=transfer_config())


def destination_key(destination: str, source: str, suffix: str = ".quantd.safetensors") -> str:
    """``destination`` itself, or for a prefix (``.../``) the source's file name with ``suffix`` under it."""
    if not destination.endswith("/"):
        return destination
    name = source.rsplit("/", 1)[-1]
    stem = name.rsplit(".", 1)[0] if "." in name else name
    return f"{destination}{stem}{suffix}"


def _reason(e: Exception) -> str:
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        err = response.get("Error", {})
        return f"{err.get('Code', 'error')} {err.get('Message', '')}".strip()
    return type(e).__name__
