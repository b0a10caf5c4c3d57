"""Typed SDK errors: one class per problem, all built by :func:`error_from_response`.

Every error carries ``status`` (HTTP status or ``None`` for client-side errors), ``problem``
(the RFC 9457 body as a dict), ``detail`` and ``request_id``.
"""

from __future__ import annotations

import email.utils
import json
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: the CLI's in-process runs and the server never load httpx
    import httpx

REQUEST_ID_HEADERS = ("x-request-id", "request-id")


class QuantdError(Exception):
    """Base of every error the SDK raises."""

    def __init__(
        self,
        detail: str,
        *,
        status: int | None = None,
        problem: dict[str, Any] | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.status = status
        self.problem: dict[str, Any] = problem if problem is not None else {}
        self.request_id = request_id

    def __str__(self) -> str:
        head = f"[{self.status}] " if self.status is not None else ""
        tail = f" (request id {self.request_id})" if self.request_id else ""
        return f"{head}{self.detail}{tail}"


class APIStatusError(QuantdError):
    """The server answered with an error status."""


class BadRequest(APIStatusError):
    """400."""


class AuthError(APIStatusError):
    """401 or 403: missing, wrong or insufficient API key."""


class NotFound(APIStatusError):
    """404 (also a job of another tenant)."""


class Conflict(APIStatusError):
    """409: e.g. a job's artifact or report asked for before it succeeded."""


class Gone(Conflict):
    """410: a finished job's files were removed (older than the server's job TTL, or cancelled after it
    succeeded). A subclass of :class:`Conflict`, which 410 raised before."""


class PayloadTooLarge(APIStatusError):
    """413: above the upload limit, or above the sync limit (submit a job instead)."""


class UnsupportedMedia(APIStatusError):
    """415: not a recognised weights format, or an unsafe pickle."""


class ValidationError(APIStatusError, ValueError):
    """422 from the server, or a config rejected client-side before sending (``status`` None)."""

    @property
    def errors(self) -> list[dict[str, Any]]:
        errs = self.problem.get("errors")
        return list(errs) if isinstance(errs, list) else []


class RateLimited(APIStatusError):
    """429; ``retry_after`` is the server's ``Retry-After`` in seconds, when it sent one."""

    def __init__(self, detail: str, *, retry_after: float | None = None, **kw: Any) -> None:
        super().__init__(detail, **kw)
        self.retry_after = retry_after


class StorageBusy(APIStatusError):
    """The object store answered a download's presigned URL with 429 or a 5xx: the download asks the API for a
    new URL after the store's ``Retry-After`` (``retry_after``, seconds) or the backoff, and raises this when its
    retries are spent."""

    def __init__(self, detail: str, *, retry_after: float | None = None, **kw: Any) -> None:
        super().__init__(detail, **kw)
        self.retry_after = retry_after


class ServerError(APIStatusError):
    """5xx."""


class APIConnectionError(QuantdError):
    """The request did not get an answer: connection refused or dropped, DNS, protocol error."""


class APITimeoutError(APIConnectionError):
    """The request timed out (connect, read, write or pool)."""


class ChecksumMismatch(QuantdError):
    """A downloaded artifact's sha256 is not the one the server announced; the file was removed."""


class JobTimeout(QuantdError, TimeoutError):
    """``Job.wait(timeout=...)`` ran out before the job reached a terminal status."""


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequest,
    401: AuthError,
    403: AuthError,
    404: NotFound,
    409: Conflict,
    410: Gone,
    413: PayloadTooLarge,
    415: UnsupportedMedia,
    422: ValidationError,
    429: RateLimited,
}


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """``Retry-After`` as seconds from now: delta-seconds or an HTTP-date; ``None`` if absent/garbled."""
    if value is None:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    current = time.time() if now is None else now
    return max(0.0, when.timestamp() - current)


def request_id_of(response: httpx.Response) -> str | None:
    for h in REQUEST_ID_HEADERS:
        if h in response.headers:
            return response.headers[h]
    return None


def _problem_of(response: httpx.Response) -> dict[str, Any]:
    try:
        body = json.loads(response.content)
    except (ValueError, UnicodeDecodeError):
        text = response.content[:500].decode("utf-8", "replace").strip()
        return {"title": response.reason_phrase, "status": response.status_code,
                "detail": text or response.reason_phrase or f"HTTP {response.status_code}"}
    if isinstance(body, dict):
        raw = body.get("detail")
        if isinstance(raw, list):
            # FastAPI's own 422 shape: {"detail": [{"loc", "msg", ...}]}
            msgs = [str(e.get("msg", e)) if isinstance(e, dict) else str(e) for e in raw]
            body = {**body, "errors": raw, "detail": "; ".join(msgs)}
        elif raw is not None and not isinstance(raw, str):
            body = {**body, "detail": json.dumps(raw)}
        return body
    return {"title": response.reason_phrase, "status": response.status_code, "detail": json.dumps(body)}


def error_from_response(response: httpx.Response) -> APIStatusError:
    """The one factory: an error response (already read) → its typed exception."""
    status = response.status_code
    problem = _problem_of(response)
    detail = str(problem.get("detail") or problem.get("title") or f"HTTP {status}")
    request_id = request_id_of(response) or (str(problem["request_id"]) if problem.get("request_id") else None)
    cls: type[APIStatusError] = _BY_STATUS.get(status, ServerError if status >= 500 else APIStatusError)
    if cls is RateLimited:
        return RateLimited(detail, retry_after=parse_retry_after(response.headers.get("retry-after")),
                           status=status, problem=problem, request_id=request_id)
    return cls(detail, status=status, problem=problem, request_id=request_id)


def error_from_transport(exc: httpx.TransportError) -> APIConnectionError:
    import httpx

    cls = APITimeoutError if isinstance(exc, httpx.TimeoutException) else APIConnectionError
    return cls(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
