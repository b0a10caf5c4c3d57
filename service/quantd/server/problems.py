"""RFC 9457 problem details for every error the server returns, Starlette's own included."""

from __future__ import annotations

import errno
import logging
import re
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Mount

from quantd.errors import (
    ConfigError,
    InputTooLargeError,
    JobCancelled,
    MalformedInputError,
    QuantdError,
    UnsafeInputError,
    UnsupportedFormatError,
)
from quantd.jobs.errors import (
    DatabaseUnavailable,
    DestinationInvalid,
    IdempotencyConflict,
    InvalidListQuery,
    JobExpired,
    JobFileNotFound,
    JobNotFound,
    JobNotReady,
    QueueFull,
    SourceForbidden,
    SourceInvalid,
    StorageError,
)

log = logging.getLogger("quantd.server")

PROBLEM_JSON = "application/problem+json"


class ProblemException(Exception):
    """Raised by routes and dependencies (HTTP layer only) to answer with a problem."""

    def __init__(self, status: int, detail: str, *, title: str | None = None, type_: str = "about:blank",
                 headers: Mapping[str, str] | None = None, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.title = title or _phrase(status)
        self.type_ = type_
        self.headers = dict(headers or {})
        self.errors = errors


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def request_id_of(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


def problem_response(status: int, detail: str, *, title: str | None = None, type_: str = "about:blank",
                     errors: list[dict[str, Any]] | None = None, headers: Mapping[str, str] | None = None,
                     request_id: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"type": type_, "title": title or _phrase(status), "status": status, "detail": detail}
    if errors is not None:
        body["errors"] = errors
    if request_id is not None:
        body["request_id"] = request_id
    return JSONResponse(body, status_code=status, headers=dict(headers or {}), media_type=PROBLEM_JSON)


def _loc(loc: Sequence[Any]) -> list[str | int]:
    return [p if isinstance(p, int) else str(p) for p in loc]


# A scheme validator's message names the field it refuses (``scheme.symmetric: …``, ``rules[0] (…):
# scheme.observer_args.percentile must …``): its error's ``loc`` stops at the model the validator is on.
_FIELD_IN_MSG = re.compile(r"^(?:rules\[(\d+)\] \([^)]*\): )?scheme\.([a-z_]+(?:\.[A-Za-z0-9_]+)?)\b")


def _field_loc(loc: list[str | int], msg: str, *, schemes: bool) -> list[str | int]:
    """``loc`` extended by the field a cross-field validator's message names, where ``loc`` stops at a scheme:
    ``…scheme`` or the config itself (a rule's) in a QuantConfig, a scheme's own root or list index where the
    validated value is schemes (``schemes``)."""
    m = _FIELD_IN_MSG.match(msg)
    if m is None:
        return loc
    rule, path = m.group(1), m.group(2).split(".")
    if not schemes and loc[:1] == ["config"]:  # a JSON body's config (by reference): the same, under "config"
        return ["config", *_field_loc(loc[1:], msg, schemes=False)]
    if schemes:
        return [*loc, *path] if not loc or isinstance(loc[-1], int) else loc
    if rule is not None:
        return loc if loc else ["rules", int(rule), "scheme", *path]
    if loc and loc[-1] == "scheme":
        return [*loc, *path]
    return loc if loc else ["scheme", *path]


def validation_errors(errors: Sequence[Mapping[str, Any]], *, prefix: Sequence[str | int] = (),
                      schemes: bool = False) -> list[dict[str, Any]]:
    """Pydantic error dicts → ``[{"loc", "msg"}]`` (input values are left out: they may be large or secret;
    our validators' messages lose pydantic's "Value error, " prefix; a cross-field validator's ``loc`` goes on
    to the field its message names: ``schemes`` when the value validated is a scheme or a list of them)."""
    out = []
    for e in errors:
        msg = str(e.get("msg", "")).removeprefix("Value error, ")
        out.append({"loc": [*prefix, *_field_loc(list(_loc(e.get("loc", ()))), msg, schemes=schemes)], "msg": msg})
    return out


def form_validation_problem(field: str, exc: ValidationError) -> ProblemException:
    """A pydantic error in a JSON form field (``config``, ``configs``, ``observer``) → 422 naming the field."""
    errs = validation_errors(exc.errors(include_url=False), prefix=("body", field), schemes=field != "config")
    first = errs[0] if errs else {"loc": ["body", field], "msg": "invalid"}
    detail = f"{'.'.join(str(p) for p in first['loc'][1:])}: {first['msg']}"
    if first["loc"][1:3] == ["config", "scheme"]:  # the tensors it concerns (CONTRACT §1: name the tensor)
        detail += " (the default scheme: every tensor that no rule matches)"
    if len(errs) > 1:
        detail += f" (and {len(errs) - 1} more)"
    return ProblemException(422, detail, title="Validation failed", type_="urn:quantd:validation-error",
                            errors=errs)


# The HTTP status of each domain error class (``quantd.errors``, ``quantd.jobs.errors``): the one place where
# they meet HTTP. A subclass answers with its nearest mapped ancestor's status.
STATUS_OF: dict[type[QuantdError], int] = {
    QuantdError: 400,
    ConfigError: 422,
    MalformedInputError: 422,
    UnsupportedFormatError: 415,
    UnsafeInputError: 415,
    InputTooLargeError: 413,
    JobCancelled: 409,
    JobNotFound: 404,
    JobFileNotFound: 404,
    JobNotReady: 409,
    JobExpired: 410,
    IdempotencyConflict: 409,
    QueueFull: 429,
    DatabaseUnavailable: 503,
    InvalidListQuery: 422,
    StorageError: 500,
    SourceForbidden: 403,
    SourceInvalid: 422,
    DestinationInvalid: 422,
}


def status_of(error: QuantdError | type[QuantdError]) -> int:
    """The HTTP status a domain error answers with (:data:`STATUS_OF`, by the class's MRO)."""
    cls = error if isinstance(error, type) else type(error)
    return next(STATUS_OF[c] for c in cls.__mro__ if c in STATUS_OF)  # QuantdError is always there


def _quantd_error(request: Request, exc: QuantdError) -> JSONResponse:
    status = status_of(exc)
    if status >= 500 and status != 503:  # a server fault: its detail may name internal paths; log, answer plainly
        log.error("server error: %s", exc.detail, exc_info=exc, extra={"request_id": request_id_of(request)})
        return problem_response(status, "internal server error; quote the request id when reporting it",
                                title=exc.title, type_=exc.type_, request_id=request_id_of(request))
    if status == 503:
        log.warning("unavailable: %s", exc.detail, exc_info=exc.__cause__, extra={"request_id": request_id_of(request)})
    errors = None
    if status == 422:
        loc: list[str | int] = [exc.location]
        if exc.tensor:
            loc += ["tensors", exc.tensor]
        if exc.field:
            loc.append(exc.field)
        errors = [{"loc": loc, "msg": exc.detail}]
    headers: dict[str, str] = {}
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, int(retry_after + 0.999)))
    return problem_response(status, exc.detail, title=exc.title, type_=exc.type_, errors=errors,
                            headers=headers, request_id=request_id_of(request))


def _problem(request: Request, exc: ProblemException) -> JSONResponse:
    return problem_response(exc.status, exc.detail, title=exc.title, type_=exc.type_, errors=exc.errors,
                            headers=exc.headers, request_id=request_id_of(request))


_METHOD_ORDER = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this request's path, plus OPTIONS (answered for any of them).
    Starlette's own ``Allow`` names the methods of the first route whose path matched, and FastAPI makes
    one route per method: ``GET`` and ``DELETE /v1/jobs/{id}`` are two. Each method is tried against the
    routing table (mounted apps, which accept any method, answer for themselves)."""
    routes = [r for r in request.app.router.routes if not isinstance(r, Mount)]
    methods = [m for m in _METHOD_ORDER
               if any(r.matches({**request.scope, "method": m})[0] is Match.FULL for r in routes)]
    return [*methods, "OPTIONS"] if methods and "OPTIONS" not in methods else methods


def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    detail = exc.detail if isinstance(exc.detail, str) else _phrase(exc.status_code)
    headers = dict(exc.headers or {})
    unknown = exc.status_code == 404 and detail == "Not Found"
    # an OPTIONS on a known resource (405 here) answers without a key, as a browser's preflight carries none
    routing = unknown or (exc.status_code == 405 and request.method != "OPTIONS")
    state = getattr(request.app.state, "quantd", None)
    path = request.url.path
    if routing and (path == "/v1" or path.startswith("/v1/")) and state is not None:
        from .deps import authenticate

        try:  # every /v1 call needs a key: without one, an unknown path or method is a 401 too
            authenticate(request, state)
        except ProblemException as e:
            return _problem(request, e)
    if exc.status_code == 404 and detail == "Not Found":
        detail = f"no such endpoint: {request.url.path}"
    elif exc.status_code == 405:
        allow = allowed_methods(request)
        if allow:
            if request.method == "OPTIONS":  # RFC 9110 §9.3.7: what this resource supports, no body
                return Response(status_code=204, headers={"Allow": ", ".join(allow)})
            headers["Allow"] = ", ".join(allow)
        detail = f"method {request.method} not allowed on {request.url.path}"
    return problem_response(exc.status_code, detail, headers=headers or None, request_id=request_id_of(request))


def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    errs = validation_errors(exc.errors())
    detail = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errs[:3]) or "invalid request"
    return problem_response(422, detail, title="Validation failed", type_="urn:quantd:validation-error",
                            errors=errs, request_id=request_id_of(request))


# The server's own storage failing under a request (an upload's or a result's files): the client can retry
# later or elsewhere, so a 507 or 503 that says so, not a 500; the detail names no server path.
_STORAGE_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
_STORAGE_DOWN = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO})


def unhandled_problem(exc: BaseException, request_id: str | None) -> JSONResponse:
    """The answer to an exception no handler took: 507/503 when the server's storage failed under the request,
    else 500 (the caller logs it)."""
    code = exc.errno if isinstance(exc, OSError) else None
    if code in _STORAGE_FULL:
        return problem_response(507, "the server's storage is full; retry later", title="Insufficient Storage",
                                type_="urn:quantd:storage-full", headers={"Retry-After": "60"},
                                request_id=request_id)
    if code in _STORAGE_DOWN:
        reason = errno.errorcode.get(code or 0, str(code))
        return problem_response(503, f"the server's storage cannot be written ({reason}); retry later",
                                title="Storage unavailable", type_="urn:quantd:storage-unavailable",
                                headers={"Retry-After": "30"}, request_id=request_id)
    return problem_response(500, "internal server error; quote the request id when reporting it",
                            request_id=request_id)


def _internal(request: Request, exc: Exception) -> JSONResponse:
    rid = request_id_of(request)
    log.error("unhandled error", exc_info=exc, extra={"request_id": rid})
    return unhandled_problem(exc, rid)


def install_problem_handlers(app: FastAPI) -> None:
    # Starlette types handlers as (Request, Exception); each one is registered for its own class.
    app.add_exception_handler(QuantdError, _quantd_error)  # type: ignore[arg-type]
    app.add_exception_handler(ProblemException, _problem)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _request_validation)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _internal)


PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "title", "status", "detail"],
    "properties": {
        "type": {"type": "string", "format": "uri-reference"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "errors": {"type": "array", "items": {"type": "object", "properties": {
            "loc": {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]}},
            "msg": {"type": "string"}}}},
        "request_id": {"type": "string"},
    },
}

# The examples' problem types: those of the errors these statuses carry most often, from the error classes
# themselves (400/401/416 and /readyz's 503 are about:blank).
_EXAMPLE_TYPES: dict[int, str] = {status_of(cls): cls.type_ for cls in (
    JobNotFound, JobNotReady, JobExpired, InputTooLargeError, UnsupportedFormatError, ConfigError, QueueFull)}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}

_EXAMPLES: dict[int, tuple[str, str]] = {
    400: ("Bad Request", "multipart body has no 'file' part"),
    401: ("Unauthorized", "missing or invalid API key: send 'Authorization: Bearer <key>'"),
    404: ("Not Found", "job 'j_0123' not found"),
    409: ("Job not ready", "job 'j_0123' is running; the report exists once it has succeeded"),
    410: ("Job expired", "job 'j_0123' finished more than job_ttl_s ago; its files are gone"),
    413: ("Payload too large", "upload exceeds the sync limit of 268435456 bytes; submit it to /v1/jobs"),
    415: ("Unsupported media type", "not a safetensors, PyTorch, .npy or .npz file (magic bytes)"),
    416: ("Range Not Satisfiable", "range starts past the end of the 1234-byte artifact"),
    422: ("Config cannot apply", "field 'group_size' tensor 'layers.0.weight': 100 does not divide 4096"),
    429: ("Queue full", "1000 jobs queued; retry later"),
    408: ("Request Timeout", "no bytes of the body arrived for 120 s: the upload is dropped"),
    503: ("Service Unavailable", "the server is shutting down; retry on another replica"),
    507: ("Insufficient Storage", "the server's storage is full; retry later"),
}


def problem_responses(*statuses: int, examples: Mapping[type[QuantdError], str] | None = None
                      ) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` entries for the given problem statuses, with an example each; ``examples``:
    a route's own error class (its status, type and title) and an example detail, where the common
    example of that status does not fit."""
    own = {status_of(cls): (cls.type_, cls.title, detail) for cls, detail in (examples or {}).items()}
    out: dict[int | str, dict[str, Any]] = {}
    for s in statuses:
        title, detail = _EXAMPLES.get(s, (_phrase(s), _phrase(s)))
        type_ = _EXAMPLE_TYPES.get(s, "about:blank")
        if s in own:
            type_, title, detail = own[s]
        example: dict[str, Any] = {"type": type_, "title": title, "status": s, "detail": detail}
        if s == 422 and s not in own:
            example["errors"] = [{"loc": ["body", "config", "scheme", "group_size"], "msg": detail}]
        out[s] = {"description": title, "content": {PROBLEM_JSON: {"schema": PROBLEM_SCHEMA, "example": example}}}
        if s in (429, 503):  # both come with Retry-After (the SDK waits that long)
            out[s]["headers"] = _RETRY_AFTER
    return out
