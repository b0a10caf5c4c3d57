"""Serving a stored file: ETag, If-Match (412), If-None-Match (304), single ``Range`` (206 / 416), streamed in
chunks."""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from .problems import problem_response, request_id_of

CHUNK = 1 << 20
_RANGE_RE = re.compile(r"^bytes=([0-9]*)-([0-9]*)$")
# A position with more digits than this is past the end of anything served: read as _FAR, never as int()
# (whose 4300-digit limit would raise on it).
_MAX_DIGITS = 20
_FAR = 10**_MAX_DIGITS


def _pos(digits: str) -> int:
    digits = digits.lstrip("0") or "0"
    return _FAR if len(digits) > _MAX_DIGITS else int(digits)


def parse_range(header: str, size: int) -> tuple[int, int] | str | None:
    """One ``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` range → ``(start, end_inclusive)``.

    Returns None for a header to ignore (malformed, or several ranges: RFC 9110 lets a server
    answer those with the whole file), and the string ``"unsatisfiable"`` for a range past the end.
    Positions of any length are read (RFC 9110 §14.1.1): a last position past the end stands for the end,
    a first one past the end is unsatisfiable, a suffix longer than the file is the whole file."""
    m = _RANGE_RE.match(header.strip().replace(" ", ""))
    if m is None:
        return None
    a, b = m.groups()
    if not a and not b:
        return None
    if not a:  # suffix range: the last n bytes
        n = _pos(b)
        if n == 0:
            return "unsatisfiable"
        return (max(0, size - n), size - 1) if size else "unsatisfiable"
    start = _pos(a)
    end = min(_pos(b), size - 1) if b else size - 1
    if b and _pos(b) < start:
        return None
    if start >= size:
        return "unsatisfiable"
    return start, end


async def _chunks(path: Path, start: int, length: int) -> AsyncIterator[bytes]:
    async with await anyio.open_file(path, "rb") as f:
        await f.seek(start)
        left = length
        while left > 0:
            chunk = await f.read(min(CHUNK, left))
            if not chunk:
                break
            left -= len(chunk)
            yield chunk


def file_response(request: Request, path: Path, *, etag_hex: str, media_type: str = "application/octet-stream",
                  filename: str | None = None, headers: dict[str, str] | None = None,
                  on_done: Callable[[], None] | None = None, window: tuple[int, int] | None = None) -> Response:
    """The file at ``path`` with strong ETag ``"<etag_hex>"``, honouring If-None-Match, Range and If-Range, and
    HEAD (the headers a GET would get, no body)."""
    return ranged_response(request, os.stat(path).st_size, lambda start, length: _chunks(path, start, length),
                           etag_hex=etag_hex, media_type=media_type, filename=filename, headers=headers,
                           on_done=on_done)


# Reads ``length`` bytes from ``start`` of what is served, as chunks.
ChunkReader = Callable[[int, int], AsyncIterator[bytes]]


def content_disposition(filename: str) -> str:
    """``attachment`` named ``filename``: an ASCII ``filename`` (other characters, quotes and backslashes as
    ``_``) and, where that is not the name itself, RFC 6266's UTF-8 ``filename*``. Header values are Latin-1
    on the wire, so a name such as ``模型.safetensors`` cannot go in as it is."""
    plain = "".join(c if " " <= c <= "~" and c not in '"\\' else "_" for c in filename)
    value = f'attachment; filename="{plain}"'
    if plain != filename:
        value += f"; filename*=UTF-8''{urllib.parse.quote(filename, safe='')}"
    return value


def ranged_response(request: Request, size: int, read: ChunkReader, *, etag_hex: str,
                    media_type: str = "application/octet-stream", filename: str | None = None,
                    headers: dict[str, str] | None = None, on_done: Callable[[], None] | None = None) -> Response:
    """``size`` bytes served through ``read`` (a local file, an object store's ranged GETs) as
    :func:`file_response` serves a file."""
    etag = f'"{etag_hex}"'
    base = {"ETag": etag, "Accept-Ranges": "bytes", **(headers or {})}
    if filename:
        base["Content-Disposition"] = content_disposition(filename)
    background = BackgroundTask(on_done) if on_done else None
    im = request.headers.get("if-match")  # strong comparison (RFC 9110 §13.1.1): a weak tag never matches
    if im is not None and im.strip() != "*" and etag not in [t.strip() for t in im.split(",")]:
        resp = problem_response(412, f"If-Match {im!r} does not match the current ETag {etag}",
                                title="Precondition Failed", headers={"ETag": etag}, request_id=request_id_of(request))
        resp.background = background
        return resp
    inm = request.headers.get("if-none-match")
    if inm is not None and (inm.strip() == "*" or etag in [t.strip().removeprefix("W/") for t in inm.split(",")]):
        return Response(status_code=304, headers={"ETag": etag}, background=background)
    rng = request.headers.get("range")
    if_range = request.headers.get("if-range")
    if rng is not None and (if_range is None or if_range.strip() == etag):
        parsed = parse_range(rng, size)
        if parsed == "unsatisfiable":
            resp = problem_response(416, f"range {rng!r} is outside the {size}-byte file",
                                    headers={"Content-Range": f"bytes */{size}"}, request_id=request_id_of(request))
            resp.background = background
            return resp
        if isinstance(parsed, tuple):
            start, end = parsed
            length = end - start + 1
            return _body(request, read, start, length, 206, media_type, background,
                         {**base, "Content-Range": f"bytes {start}-{end}/{size}"})
    return _body(request, read, 0, size, 200, media_type, background, base)


def _body(request: Request, read: ChunkReader, start: int, length: int, status: int, media_type: str,
          background: BackgroundTask | None, headers: dict[str, str]) -> Response:
    """``length`` bytes of the file from ``start``, streamed; for HEAD the same status and headers, no body."""
    headers = {**headers, "Content-Length": str(length)}
    if request.method == "HEAD":
        return Response(status_code=status, media_type=media_type, headers=headers, background=background)
    return StreamingResponse(read(start, length), status_code=status, media_type=media_type,
                             background=background, headers=headers)
