"""Streaming multipart uploads: file parts go straight to a temp file under ``data_dir/tmp``, hashed
while they stream; the size limit is enforced from ``Content-Length`` before the body is read and
again byte by byte while it streams. Nothing is spooled whole in memory.

The client's filename is kept for display only (sanitised); the stored path is a random name.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import re
import threading
import unicodedata
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, cast

import anyio
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from quantd.io.files import start_writeback
from quantd.io.finite_scan import FiniteScan

from .problems import ProblemException

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

# An upload that sends nothing for this long is dropped (408), its temp files with it: a client that
# stopped without closing its connection holds no disk space and no connection slot for longer.
UPLOAD_IDLE_S = 120.0

# Room for the multipart framing and the small JSON fields around a file at the size limit.
FORM_OVERHEAD_BYTES = 1024 * 1024
MAX_FIELD_BYTES = 256 * 1024
WRITE_BATCH_BYTES = 1024 * 1024
# The longest header line of a part: its Content-Disposition holds the filename, a model directory's path.
MAX_PART_HEADER_BYTES = 64 * 1024
# An upload's bytes are handed to the disk every this many bytes, so that the fsync that makes the job
# durable before its 202 finds little left to write.
WRITEBACK_BYTES = 16 * 1024 * 1024
_UNSAFE_CHARS = re.compile(r"[^\w.\- ()+=,@]")


def filename_param(disposition: bytes) -> bytes | None:
    """The ``filename`` parameter of a ``Content-Disposition`` header as sent, unquoted as python-multipart
    does (``\\\\`` and ``\\"`` inside quotes; any other backslash kept). Its own parser cuts a value like
    ``C:\\dir\\x.json`` down to ``x.json`` (a workaround for old browsers that sent full Windows paths);
    a model directory's part names are checked as the client wrote them, so such a name is refused, naming
    the path, not renamed."""
    text = disposition.decode("latin-1")
    params, cur, quoted, i = [], [], False, 0
    while i < len(text):
        ch = text[i]
        if quoted and ch == "\\" and text[i + 1:i + 2] in ("\\", '"'):
            cur.append(text[i + 1])
            i += 2
            continue
        if ch == '"':
            quoted = not quoted
        if ch == ";" and not quoted:
            params.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
        i += 1
    params.append("".join(cur))
    for param in params[1:]:
        key, eq, value = param.partition("=")
        if eq and key.strip().lower() == "filename":
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] == '"':
                value = value[1:-1]
            return value.encode("latin-1")
    return None


def sanitize_filename(raw: str | None, *, default: str = "upload") -> str:
    """A display name: the last path component, no control characters, at most 200 characters."""
    if not raw:
        return default
    name = unicodedata.normalize("NFC", raw).replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(c for c in name if unicodedata.category(c)[0] != "C")
    name = _UNSAFE_CHARS.sub("_", name).strip(" .")
    return name[:200] or default


@dataclass
class UploadedFile:
    """One file part stored on disk. ``path`` is ours (random name under data_dir/tmp)."""

    field: str
    path: Path
    filename: str
    bytes: int
    sha256: str
    raw_filename: str | None = None  # as the client sent it: a model directory's relative path, checked later
    # Its float tensors with NaN or Inf, found while it streamed (a safetensors file; None: not followed)
    non_finite: list[str] | None = None


@dataclass
class MultipartForm:
    files: dict[str, UploadedFile] = field(default_factory=dict)
    fields: dict[str, str] = field(default_factory=dict)
    # Every part of a field that may repeat (a model directory's files), in the order received; the first
    # is also ``files[name]``.
    file_lists: dict[str, list[UploadedFile]] = field(default_factory=dict)

    def cleanup(self) -> None:
        """Delete every temp file of this form that still exists (a consumer may have moved it)."""
        for f in [*self.files.values(), *(f for fs in self.file_lists.values() for f in fs)]:
            with contextlib.suppress(FileNotFoundError):
                f.path.unlink()


def too_large(limit: int, hint: str) -> ProblemException:
    return ProblemException(413, f"upload exceeds {limit} bytes{hint}", title="Payload too large",
                            type_="urn:quantd:too-large")


class FileSink(Protocol):
    """Told how far a file part has been written while it streams (e.g. a quantization reading it)."""

    def advance(self, nbytes: int) -> None: ...
    def complete(self) -> None: ...
    def abort(self) -> None: ...


# Called (on the upload's writer thread) when a file part begins, with the text fields received so far.
OnFileStart = Callable[[UploadedFile, dict[str, str]], FileSink | None]


class _Collector:
    """python-multipart callbacks → temp files and text fields, enforcing limits as bytes arrive."""

    def __init__(self, tmp_dir: Path, *, file_fields: set[str], text_fields: set[str], max_file_bytes: int,
                 hint: str, on_file_start: OnFileStart | None = None,
                 repeatable: frozenset[str] = frozenset()) -> None:
        self.tmp_dir = tmp_dir
        self.repeatable = repeatable
        self._files_bytes = 0  # all file parts together (the size limit applies to their sum)
        self.on_file_start = on_file_start
        self._sink: FileSink | None = None
        self.file_fields = file_fields
        self.text_fields = text_fields
        self.max_file_bytes = max_file_bytes
        self.hint = hint
        self.form = MultipartForm()
        self._header_field = b""
        self._header_value = b""
        self._headers: dict[bytes, bytes] = {}
        self._name = ""
        self._fh: BinaryIO | None = None
        self._flushed = 0
        self._file: UploadedFile | None = None
        self._hash: Any = None
        self._scan = FiniteScan()
        self._text = bytearray()
        self._is_file = False

    def callbacks(self) -> dict[str, Callable[..., None]]:
        return {
            "on_part_begin": self._part_begin, "on_header_field": self._header_field_cb,
            "on_header_value": self._header_value_cb, "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished, "on_part_data": self._part_data,
            "on_part_end": self._part_end,
        }

    def _part_begin(self) -> None:
        self._headers = {}
        self._text = bytearray()

    def _header_field_cb(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def _header_value_cb(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._header_field.lower()] = self._header_value
        self._header_field = b""
        self._header_value = b""

    def _headers_finished(self) -> None:
        disposition, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        if disposition != b"form-data" or b"name" not in options:
            raise ProblemException(400, "multipart part without 'Content-Disposition: form-data; name=...'")
        self._name = options[b"name"].decode("utf-8", "replace")
        again = self._name in self.form.files and self._name not in self.repeatable
        if again or self._name in self.form.fields:
            raise ProblemException(400, f"multipart field {self._name!r} given twice")
        self._is_file = self._name in self.file_fields
        if self._is_file:
            raw = filename_param(self._headers.get(b"content-disposition", b""))
            filename = sanitize_filename(raw.decode("utf-8", "replace") if raw else None)
            path = self.tmp_dir / f"upload-{uuid.uuid4().hex}"
            # Registered before the first byte so cleanup() finds even a half-written file.
            self._file = UploadedFile(self._name, path, filename, 0, "",
                                      raw.decode("utf-8", "replace") if raw is not None else None)
            first = self._name not in self.form.files
            if first:
                self.form.files[self._name] = self._file
            if self._name in self.repeatable:
                self.form.file_lists.setdefault(self._name, []).append(self._file)
            self._fh = open(path, "xb")  # noqa: SIM115 - closed in _part_end / close()
            self._flushed = 0  # bytes handed to the disk's writeback so far
            self._hash = hashlib.sha256()
            self._scan = FiniteScan()
            if self.on_file_start is not None and first:
                self._sink = self.on_file_start(self._file, dict(self.form.fields))
        elif self._name not in self.text_fields:
            expected = sorted(self.file_fields | self.text_fields)
            raise ProblemException(400, f"unexpected multipart field {self._name!r}; this endpoint takes {expected}")

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = memoryview(data)[start:end]  # no copy: hashed and written as it is
        if self._is_file:
            assert self._fh is not None and self._file is not None  # set in _headers_finished
            self._file.bytes += len(chunk)
            self._files_bytes += len(chunk)
            if self._file.bytes > self.max_file_bytes or self._files_bytes > self.max_file_bytes:
                raise too_large(self.max_file_bytes, self.hint)
            self._hash.update(chunk)
            self._scan.feed(chunk)
            self._fh.write(chunk)
            if self._sink is not None:
                self._fh.flush()  # visible to the sink's own reads
                self._sink.advance(self._file.bytes)
            if self._file.bytes - self._flushed >= WRITEBACK_BYTES:  # to disk while the rest arrives
                self._fh.flush()
                start_writeback(self._fh.fileno(), self._flushed, self._file.bytes - self._flushed)
                self._flushed = self._file.bytes
        else:
            self._text += chunk
            if len(self._text) > MAX_FIELD_BYTES:
                raise ProblemException(413, f"form field {self._name!r} exceeds {MAX_FIELD_BYTES} bytes",
                                       title="Payload too large")

    def _part_end(self) -> None:
        if self._is_file:
            assert self._fh is not None and self._file is not None
            self._fh.close()
            self._fh = None
            self._file.sha256 = self._hash.hexdigest()
            self._file.non_finite = self._scan.non_finite()
            if self._sink is not None:
                self._sink.advance(self._file.bytes)
                self._sink.complete()
                self._sink = None
        else:
            try:
                self.form.fields[self._name] = self._text.decode("utf-8")
            except UnicodeDecodeError:
                raise ProblemException(400, f"form field {self._name!r} is not UTF-8") from None

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._sink is not None:  # a file part that never ended
            self._sink.abort()
            self._sink = None


class _BatchWriter:
    """Feeds body batches to the multipart parser (whose callbacks hash and write the file) on a
    thread of its own, so that receiving overlaps parsing, hashing and writing. The first error the
    parser raises is re-raised on the event loop by the next ``put``/``finish``."""

    DEPTH = 4  # batches queued at most: bounds the memory of one upload to ~DEPTH MiB

    def __init__(self, parser: MultipartParser) -> None:
        self._parser = parser
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=self.DEPTH)
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="upload-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            if self._error is None and not self._stop:
                try:
                    self._parser.write(batch)
                except BaseException as e:  # handed to the event loop by put()/finish()
                    self._error = e
        if self._error is None and not self._stop:
            try:
                self._parser.finalize()
            except BaseException as e:  # handed to the event loop by finish()
                self._error = e

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    async def _enqueue(self, item: bytes | None) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:  # the thread is behind: wait for room off the event loop
            await anyio.to_thread.run_sync(self._queue.put, item)

    async def put(self, batch: bytes) -> None:
        self._raise()
        await self._enqueue(batch)

    async def finish(self) -> None:
        await self._enqueue(None)
        await anyio.to_thread.run_sync(self._thread.join)
        self._raise()

    async def abort(self) -> None:
        """Stop writing (queued batches are dropped) and wait for the thread: the caller then closes
        and deletes the files."""
        self._stop = True
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        await self._enqueue(None)
        await anyio.to_thread.run_sync(self._thread.join)


async def receive_multipart(request: Request, *, tmp_dir: Path, max_file_bytes: int, file_fields: set[str],
                            text_fields: set[str], required: set[str], hint: str = "",
                            on_file_start: OnFileStart | None = None,
                            repeatable: frozenset[str] = frozenset(),
                            stopping: Callable[[], bool] = lambda: False) -> MultipartForm:
    """Parse a ``multipart/form-data`` body while it streams. Raises ProblemException 400/413/415;
    on any failure the temp files written so far are deleted (and their sinks aborted).
    ``on_file_start``: see :data:`OnFileStart`; it must not raise; it is called for a field's first part.
    ``repeatable``: file fields that may come several times (``form.file_lists``); ``max_file_bytes``
    bounds the sum of all file parts. ``stopping()`` true (the server is shutting down): the upload is
    answered 503 with ``Retry-After`` at its next chunk, rather than cut after the graceful timeout."""
    ctype, options = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or not options.get(b"boundary"):
        raise ProblemException(415, "expected a multipart/form-data body with a boundary",
                               title="Unsupported media type")
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise ProblemException(400, "Content-Length is not a number")
        if int(length) > max_file_bytes + FORM_OVERHEAD_BYTES:
            raise too_large(max_file_bytes, hint)
    tmp_dir.mkdir(parents=True, exist_ok=True)
    col = _Collector(tmp_dir, file_fields=file_fields, text_fields=text_fields, max_file_bytes=max_file_bytes,
                     hint=hint, on_file_start=on_file_start, repeatable=repeatable)
    # Room for a path far past the longest one §8's check takes, so that a long path gets that check's 422
    # naming it rather than a 400 from the parser; still bounded.
    parser = MultipartParser(options[b"boundary"], cast("MultipartCallbacks", col.callbacks()),
                             max_header_size=MAX_PART_HEADER_BYTES)
    writer = _BatchWriter(parser)
    total = 0
    # Network chunks are small: they are gathered into 1 MiB batches, which a thread parses, hashes and
    # writes while the event loop receives the next ones (at most _BatchWriter.DEPTH batches in flight).
    pending: list[bytes] = []
    pending_bytes = 0
    chunks = request.stream().__aiter__()
    try:
        while True:
            try:
                with anyio.fail_after(UPLOAD_IDLE_S):
                    chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise ProblemException(408, f"no bytes of the body arrived for {UPLOAD_IDLE_S:g} s: the upload "
                                            "was dropped", title="Request Timeout") from None
            if stopping():
                raise ProblemException(503, "the server is shutting down: send the upload again (to another "
                                            "replica, or once it is back)", title="Service Unavailable",
                                       headers={"Retry-After": "5"})
            total += len(chunk)
            if total > max_file_bytes + FORM_OVERHEAD_BYTES:
                raise too_large(max_file_bytes, hint)
            pending.append(chunk)
            pending_bytes += len(chunk)
            # Past the file limit, every chunk is parsed at once: the part's own count then answers 413 as soon
            # as the file exceeds it, not a batch later.
            if pending_bytes >= WRITE_BATCH_BYTES or total > max_file_bytes:
                await writer.put(b"".join(pending))
                pending, pending_bytes = [], 0
        if pending:
            await writer.put(b"".join(pending))
        await writer.finish()
    except MultipartParseError as e:
        await writer.abort()
        col.close()
        col.form.cleanup()
        raise ProblemException(400, f"malformed multipart body: {e}") from None
    except ClientDisconnect:
        await writer.abort()
        col.close()
        col.form.cleanup()
        raise ProblemException(400, "client disconnected before the body was complete") from None
    except BaseException:
        await writer.abort()
        col.close()
        col.form.cleanup()
        raise
    missing = sorted(required - set(col.form.files) - set(col.form.fields))
    unfinished = any(f.sha256 == "" for f in col.form.files.values()) or any(
        f.sha256 == "" for fs in col.form.file_lists.values() for f in fs)
    if missing or unfinished:
        col.close()
        col.form.cleanup()
        if unfinished:
            raise ProblemException(400, "multipart body ended inside a file part")
        # A complete body without a required field: 422 located in the body, as FastAPI answers it.
        raise ProblemException(422, f"multipart body is missing required field(s) {missing}",
                               title="Validation failed", type_="urn:quantd:validation-error",
                               errors=[{"loc": ["body", name], "msg": "Field required"} for name in missing])
    return col.form


def remove_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
