"""What Client and AsyncClient share: URL and header building, the retry policy, error mapping,
request-id capture, config coercion, SSE decoding and download bookkeeping. Only the I/O differs.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import random
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
import pydantic

from ._exceptions import (
    APIConnectionError,
    APIStatusError,
    StorageBusy,
    ValidationError,
    error_from_response,
    parse_retry_after,
    request_id_of,
)
from ._progress import ProgressArg
from ._schemas import ObserverSpec, QuantConfig, Scheme
from ._upload import FilePart, MultipartBody, UploadInput, directory_parts, make_file_part

DEFAULT_TIMEOUT = httpx.Timeout(300.0, connect=10.0)
DEFAULT_MAX_RETRIES = 3
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
RETRY_STATUSES = frozenset({429, 503})
TERMINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled"})
MAX_PAGE_SIZE = 100  # the server's largest GET /v1/jobs ?limit=


def _sdk_version() -> str:
    try:
        return importlib.metadata.version("quantd")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


USER_AGENT = f"quantd-python/{_sdk_version()} httpx/{httpx.__version__}"

_M = TypeVar("_M", bound=pydantic.BaseModel)
ConfigArg = QuantConfig | Mapping[str, Any]
SchemeArg = Scheme | Mapping[str, Any]
TimeoutArg = float | httpx.Timeout | None


@dataclass(frozen=True)
class RetryPolicy:
    """Jittered exponential backoff, capped; ``Retry-After`` (capped at ``max_retry_after``) wins."""

    max_retries: int = DEFAULT_MAX_RETRIES
    base_delay: float = 0.5
    max_delay: float = 8.0
    max_retry_after: float = 60.0

    def delay(self, attempt: int, response: httpx.Response | None = None,
              rand: Callable[[], float] = random.random, *, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number ``attempt + 1`` (attempt counts from 0); ``retry_after``: a
        ``Retry-After`` already parsed (an error's), when there is no response."""
        after = parse_retry_after(response.headers.get("retry-after")) if response is not None else retry_after
        if after is not None:
            return min(after, self.max_retry_after)
        backoff = min(self.max_delay, self.base_delay * (2 ** attempt))
        return float(backoff * (0.5 + 0.5 * rand()))  # "equal jitter": never below half the backoff


@dataclass
class RequestSpec:
    """One logical request; the client may send it several times."""

    method: str
    path: str
    params: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    json: Any = None
    body: MultipartBody | None = None
    upload_progress: ProgressArg = False
    upload_label: str = "upload"
    max_retries: int | None = None  # None: the client's policy

    @property
    def replayable(self) -> bool:
        return self.body is None or self.body.replayable


@dataclass
class ServerSentEvent:
    event: str = "message"
    data: str = ""
    id: str | None = None

    def json(self) -> Any:
        return json.loads(self.data) if self.data else None


class SSEDecoder:
    """Line-by-line text/event-stream decoder (the WHATWG algorithm, minus reconnection)."""

    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []
        self._id: str | None = None

    def feed(self, line: str) -> ServerSentEvent | None:
        line = line.rstrip("\r\n")
        if not line:
            if not self._data and not self._event:
                return None
            ev = ServerSentEvent(self._event or "message", "\n".join(self._data), self._id)
            self._event, self._data = "", []
            return ev
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id":
            self._id = value
        return None


def coerce_config(config: ConfigArg) -> QuantConfig:
    """A QuantConfig or a plain dict of the same shape, validated here before anything is sent."""
    if isinstance(config, QuantConfig):
        return config
    return _validate(QuantConfig, config, "config")


def coerce_scheme(scheme: SchemeArg, where: str = "scheme") -> Scheme:
    return scheme if isinstance(scheme, Scheme) else _validate(Scheme, scheme, where)


def coerce_observer(spec: ObserverSpec | Mapping[str, Any]) -> ObserverSpec:
    return spec if isinstance(spec, ObserverSpec) else _validate(ObserverSpec, spec, "observer")


def _validate(model: type[_M], data: Any, where: str) -> _M:
    try:
        return model.model_validate(dict(data) if isinstance(data, Mapping) else data)
    except pydantic.ValidationError as e:
        errors = [{"loc": [where, *e_["loc"]], "msg": e_["msg"]} for e_ in e.errors()]
        detail = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in errors)
        raise ValidationError(detail, problem={"title": "Invalid config", "detail": detail,
                                               "errors": errors}) from None


def config_json(config: QuantConfig) -> str:
    return config.model_dump_json(exclude_unset=False)


def new_idempotency_key() -> str:
    return uuid.uuid4().hex


def prepare_destination(dst: Path, job_id: str) -> Path:
    """``dst`` with its parent folders made; ValidationError when it is a folder: a one-file artifact is
    written to the file it names."""
    if dst.is_dir():
        raise ValidationError(f"job {job_id}: {dst} is a folder; name the file to write the artifact to "
                              f"(such as {dst / (job_id + '.quantd.safetensors')})")
    dst.parent.mkdir(parents=True, exist_ok=True)
    return dst


def part_path(path: Path) -> Path:
    return path.with_name(path.name + ".part")


def etag_sha256(response: httpx.Response) -> str | None:
    """The ETag as a bare hex digest (quotes and weak prefix stripped), when it looks like one."""
    tag = response.headers.get("etag")
    if not tag:
        return None
    tag = tag.strip()
    if tag.startswith("W/"):
        tag = tag[2:]
    tag = tag.strip('"').lower()
    return tag if len(tag) == 64 and all(c in "0123456789abcdef" for c in tag) else None


def hash_existing(path: Path) -> tuple[hashlib._Hash, int]:
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            n += len(chunk)
    return h, n


def redirect_location(response: httpx.Response) -> str | None:
    """Where a 3xx download answer sends the client (a presigned storage URL), absolute; None otherwise."""
    location = response.headers.get("location")
    if response.status_code not in (301, 302, 303, 307, 308) or not location:
        return None
    return str(response.request.url.join(location))


# A store's answers to a presigned URL that another try may not get (S3's 503 SlowDown, 500, 502, 504, 429):
# the download asks the API again, for a new URL, after the store's Retry-After or the backoff.
STORAGE_RETRY = frozenset({429, 500, 502, 503, 504})


def storage_error(response: httpx.Response) -> APIStatusError:
    """The error of a store's non-2xx answer to a presigned URL: :class:`StorageBusy` where another try may
    get it (:data:`STORAGE_RETRY`), else an APIStatusError (a refusal: bad credentials, a policy, a missing
    object)."""
    status = response.status_code
    detail = f"the artifact's storage answered {status} to its presigned URL"
    if status in STORAGE_RETRY:
        return StorageBusy(detail, status=status, retry_after=parse_retry_after(response.headers.get("retry-after")))
    return APIStatusError(detail, status=status)


def storage_request_headers(have: int) -> dict[str, str]:
    """Headers for a presigned storage URL: a Range when resuming, and none of the API's (its key stays here)."""
    return {"Range": f"bytes={have}-"} if have else {}


def content_range_start(response: httpx.Response) -> int | None:
    """The first byte of a 206's ``Content-Range: bytes a-b/n``."""
    value = response.headers.get("content-range", "")
    unit, _, rng = value.partition(" ")
    if unit.strip() != "bytes" or "-" not in rng:
        return None
    try:
        return int(rng.split("-", 1)[0])
    except ValueError:
        return None


class BaseClient:
    """Configuration and pure helpers; subclasses add the (sync or async) I/O."""

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None, timeout: TimeoutArg = DEFAULT_TIMEOUT,
                 max_retries: int = DEFAULT_MAX_RETRIES, headers: Mapping[str, str] | None = None) -> None:
        base_url = base_url or os.environ.get("QUANTD_URL") or DEFAULT_BASE_URL
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://; got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("QUANTD_API_KEY") or None
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        self.retry = RetryPolicy(max_retries=max_retries)
        self.extra_headers = dict(headers or {})
        self.last_request_id: str | None = None
        self._rand: Callable[[], float] = random.random

    @property
    def max_retries(self) -> int:
        return self.retry.max_retries

    def _url(self, path: str) -> str:
        return path if path.startswith(("http://", "https://")) else f"{self.base_url}/{path.lstrip('/')}"

    def _headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        h = {"User-Agent": USER_AGENT, "Accept": "application/json, application/problem+json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        h.update(self.extra_headers)
        if extra:
            h.update(extra)
        return h

    def _build(self, spec: RequestSpec) -> tuple[str, dict[str, str], dict[str, Any]]:
        """URL, headers and the non-body keyword arguments for one attempt."""
        headers = self._headers(spec.headers)
        kwargs: dict[str, Any] = {}
        if spec.params:
            kwargs["params"] = {k: v for k, v in spec.params.items() if v is not None}
        if spec.json is not None:
            kwargs["content"] = json.dumps(spec.json).encode()
            headers["Content-Type"] = "application/json"
        if spec.body is not None:
            headers.update(spec.body.headers)
        return self._url(spec.path), headers, kwargs

    def _retry_delay(self, spec: RequestSpec, attempt: int, *, response: httpx.Response | None = None,
                     error: Exception | None = None) -> float | None:
        """Seconds to wait before retrying, or None to give up (and raise/return)."""
        limit = self.retry.max_retries if spec.max_retries is None else spec.max_retries
        if attempt >= limit or not spec.replayable:
            return None
        if response is not None:
            if response.status_code not in RETRY_STATUSES:
                return None
            return self.retry.delay(attempt, response, self._rand)
        if isinstance(error, httpx.TransportError):
            return self.retry.delay(attempt, None, self._rand)
        return None

    def _note(self, response: httpx.Response) -> None:
        rid = request_id_of(response)
        if rid:
            self.last_request_id = rid

    @staticmethod
    def _error(response: httpx.Response) -> APIStatusError:
        return error_from_response(response)

    @staticmethod
    def _transport_error(exc: httpx.TransportError) -> APIConnectionError:
        from ._exceptions import error_from_transport

        return error_from_transport(exc)

    @staticmethod
    def _jobs_params(status: str | None, limit: int | None, cursor: str | None) -> dict[str, Any]:
        # A page holds at most MAX_PAGE_SIZE jobs (the server's largest ?limit=): larger limits page.
        return {"status": status, "limit": None if limit is None else min(limit, MAX_PAGE_SIZE), "cursor": cursor}

    @staticmethod
    def _multipart(fields: Mapping[str, str], files: list[Any]) -> MultipartBody:
        return MultipartBody(fields, files)

    # Request builders shared by both clients: only sending them differs.

    def _spec_quantize(self, x: UploadInput, config: ConfigArg | None, name: str | None,
                       progress: ProgressArg) -> RequestSpec:
        cfg = coerce_config(config if config is not None else {})
        part = make_file_part(x, name=name)
        return RequestSpec("POST", "/v1/quantize", headers={"Accept": "application/octet-stream, application/problem+json"},
                           body=MultipartBody({"config": config_json(cfg)}, [part]),
                           upload_progress=progress, upload_label=f"upload {part.filename}")

    def _spec_analyze(self, x: UploadInput, schemes: Sequence[SchemeArg] | SchemeArg,
                      name: str | None, analyses: Sequence[str] = ()) -> RequestSpec:
        items: Sequence[SchemeArg] = [schemes] if isinstance(schemes, (Scheme, Mapping)) else schemes
        checked = [coerce_scheme(s, f"schemes[{i}]") for i, s in enumerate(items)]
        if not checked:
            raise ValidationError("schemes: give at least one scheme to analyze")
        fields = {"configs": json.dumps([s.model_dump(mode="json") for s in checked])}
        if analyses:
            fields["analyses"] = json.dumps(list(analyses))
        return RequestSpec("POST", "/v1/analyze", body=MultipartBody(fields, [make_file_part(x, name=name)]))

    def _spec_calibrate(self, x: UploadInput, observer: ObserverSpec | Mapping[str, Any],
                        name: str | None) -> RequestSpec:
        spec = coerce_observer(observer)
        return RequestSpec("POST", "/v1/calibrate",
                           body=MultipartBody({"observer": spec.model_dump_json()}, [make_file_part(x, name=name)]))

    def _spec_submit(self, x: UploadInput, config: ConfigArg, calibration: UploadInput | None,
                     idempotency_key: str | None, progress: ProgressArg, name: str | None) -> RequestSpec:
        cfg = coerce_config(config)
        parts: list[FilePart]
        if isinstance(x, (str, os.PathLike)) and Path(x).is_dir():  # a model directory: one part per file
            parts = directory_parts(Path(x))
            label = f"upload {Path(x).name}/ ({len(parts)} files)"
        else:
            parts = [make_file_part(x, name=name)]
            label = f"upload {parts[0].filename}"
        if calibration is not None:
            parts.append(make_file_part(calibration, field="calibration"))
        # One key per submit, reused by every retry of it: the server deduplicates on it.
        key = idempotency_key or new_idempotency_key()
        return RequestSpec("POST", "/v1/jobs", headers={"Idempotency-Key": key},
                           body=MultipartBody({"config": config_json(cfg)}, parts),
                           upload_progress=progress, upload_label=label)

    @staticmethod
    def _spec_download(job_id: str, have: int, expected: str | None, file: str | None = None) -> RequestSpec:
        """The artifact, or with ``file`` one file of the job's output (``/v1/jobs/{id}/files/{file}``)."""
        headers = {"Accept": "application/octet-stream, application/problem+json"}
        if have:
            headers["Range"] = f"bytes={have}-"
            if expected:
                headers["If-Range"] = f'"{expected}"'
        url = f"/v1/jobs/{job_id}/artifact" if file is None else f"/v1/jobs/{job_id}/files/{quote(file)}"
        return RequestSpec("GET", url, headers=headers)


def summary_header(response: httpx.Response) -> dict[str, Any]:
    raw = response.headers.get("quantd-summary")
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def event_fraction(data: Any) -> float | None:
    """The progress fraction in a ``progress`` event's data (a Progress, or a Job carrying one)."""
    if not isinstance(data, dict):
        return None
    prog = data.get("progress", data)
    frac = prog.get("fraction") if isinstance(prog, dict) else None
    return float(frac) if isinstance(frac, (int, float)) else None
