"""The synchronous client. Everything but the I/O lives in ``_base``."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from ._base import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT,
    BaseClient,
    ConfigArg,
    RequestSpec,
    SchemeArg,
    ServerSentEvent,
    SSEDecoder,
    TimeoutArg,
    content_range_start,
    etag_sha256,
    hash_existing,
    part_path,
    prepare_destination,
    redirect_location,
    storage_error,
    storage_request_headers,
    summary_header,
)
from ._exceptions import APIConnectionError, APIStatusError, ChecksumMismatch, StorageBusy
from ._job import JobHandle
from ._progress import ProgressArg, Reporter
from ._results import Artifact
from ._schemas import STORED, AnalyzeResponse, CalibrateResponse, Info, Job, JobList, ObserverSpec, Report
from ._upload import UploadInput


class Client(BaseClient):
    """Synchronous quantd client. ``with Client(url) as c: ...`` closes the connection pool."""

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None,
                 timeout: TimeoutArg = DEFAULT_TIMEOUT, max_retries: int = DEFAULT_MAX_RETRIES,
                 headers: Mapping[str, str] | None = None, transport: httpx.BaseTransport | None = None,
                 http_client: httpx.Client | None = None) -> None:
        super().__init__(base_url, api_key=api_key, timeout=timeout, max_retries=max_retries, headers=headers)
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client(timeout=self.timeout, transport=transport)
        self._sleep: Callable[[float], None] = time.sleep
        self._clock: Callable[[], float] = time.monotonic

    def __enter__(self) -> Client:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    # -- transport --------------------------------------------------------------------------------

    def _request(self, spec: RequestSpec, *, stream: bool = False,
                 timeout: httpx.Timeout | None = None) -> httpx.Response:
        """Send with retries; returns a 2xx/3xx response (unread when ``stream``), raises the typed error."""
        attempt = 0
        while True:
            url, headers, kwargs = self._build(spec)
            reporter: Reporter | None = None
            if spec.body is not None:
                reporter = Reporter(spec.upload_progress, spec.upload_label, spec.body.content_length)
                kwargs["content"] = spec.body.iter_bytes(reporter.update)
            request = self._http.build_request(spec.method, url, headers=headers,
                                               timeout=timeout or self.timeout, **kwargs)
            try:
                response = self._http.send(request, stream=stream)
            except httpx.TransportError as e:
                delay = self._retry_delay(spec, attempt, error=e)
                if delay is None:
                    raise self._transport_error(e) from e
                self._sleep(delay)
                attempt += 1
                continue
            finally:
                if reporter is not None:
                    reporter.close()
            self._note(response)
            if response.status_code < 400:
                return response
            try:
                response.read()
            finally:
                response.close()
            delay = self._retry_delay(spec, attempt, response=response)
            if delay is None:
                raise self._error(response)
            self._sleep(delay)
            attempt += 1

    def _json(self, spec: RequestSpec) -> Any:
        return self._request(spec).json()

    # -- synchronous work ---------------------------------------------------------------------------

    def info(self) -> Info:
        """Server version, devices, dtypes, observers, formats and limits."""
        return Info.model_validate(self._json(RequestSpec("GET", "/v1/info")))

    def quantize(self, x: UploadInput, config: ConfigArg | None = None, *, name: str | None = None,
                 output: str | os.PathLike[str] | None = None, progress: ProgressArg = False) -> Artifact:
        """Quantize in one request. ``x``: a NumPy array (named ``name`` or "tensor"), a dict of arrays,
        or a path (streamed). With ``output`` the artifact is streamed to that path, else kept in memory."""
        spec = self._spec_quantize(x, config, name, progress)
        if output is None:
            response = self._request(spec)
            return Artifact(data=response.content, summary=summary_header(response),
                            request_id=self.last_request_id)
        dst = Path(output)
        tmp = part_path(dst)
        response = self._request(spec, stream=True)
        try:
            with open(tmp, "wb") as f:
                for chunk in response.iter_bytes():
                    f.write(chunk)
        except httpx.TransportError as e:
            tmp.unlink(missing_ok=True)
            raise self._transport_error(e) from e
        finally:
            response.close()
        os.replace(tmp, dst)
        return Artifact(path=dst, summary=summary_header(response), request_id=self.last_request_id)

    def analyze(self, x: UploadInput, schemes: Sequence[SchemeArg] | SchemeArg, *,
                name: str | None = None, analyses: Sequence[str] = ()) -> AnalyzeResponse:
        """Error statistics of each scheme on every tensor, without producing an artifact.

        ``analyses``: any of "bit_widths", "outlier_impact", "scale_sensitivity", run on the first scheme."""
        return AnalyzeResponse.model_validate(self._json(self._spec_analyze(x, schemes, name, analyses)))

    def calibrate(self, x: UploadInput, observer: ObserverSpec | Mapping[str, Any], *,
                  name: str | None = None) -> CalibrateResponse:
        """Static activation ranges and qparams from samples (name → ``[N, ...]``)."""
        return CalibrateResponse.model_validate(self._json(self._spec_calibrate(x, observer, name)))

    # -- jobs --------------------------------------------------------------------------------------

    def submit(self, x: UploadInput, config: ConfigArg, *, calibration: UploadInput | None = None,
               idempotency_key: str | None = None, progress: ProgressArg = None,
               name: str | None = None) -> JobHandle:
        """Upload a model (streamed from disk) as a job; 202 → a :class:`JobHandle`."""
        spec = self._spec_submit(x, config, calibration, idempotency_key, progress, name)
        return JobHandle(self, Job.model_validate(self._json(spec), context=STORED))

    def get_job(self, job_id: str) -> JobHandle:
        return JobHandle(self, self._get_job_model(job_id))

    def _get_job_model(self, job_id: str) -> Job:
        return Job.model_validate(self._json(RequestSpec("GET", f"/v1/jobs/{job_id}")), context=STORED)

    def list_jobs(self, status: str | None = None, limit: int | None = None, *,
                  page_size: int | None = None) -> Iterator[JobHandle]:
        """The caller's jobs, newest first, fetched page by page as the iterator advances.
        ``limit`` caps how many are yielded in all; ``page_size`` is the server's ``?limit=``."""
        cursor: str | None = None
        yielded = 0
        while True:
            size = page_size if limit is None else min(page_size or limit, limit - yielded)
            page = JobList.model_validate(self._json(RequestSpec(
                "GET", "/v1/jobs", params=self._jobs_params(status, size, cursor))), context=STORED)
            for job in page.items:
                if limit is not None and yielded >= limit:
                    return
                yielded += 1
                yield JobHandle(self, job)
            if not page.next_cursor or not page.items or (limit is not None and yielded >= limit):
                return
            cursor = page.next_cursor

    def cancel(self, job_id: str) -> JobHandle | None:
        """Cancel a queued or running job (its files are deleted); the job as the server left it."""
        response = self._request(RequestSpec("DELETE", f"/v1/jobs/{job_id}"))
        if response.status_code == 204 or not response.content:
            return None
        return JobHandle(self, Job.model_validate(response.json(), context=STORED))

    def _report(self, job_id: str) -> Report:
        return Report.model_validate(self._json(RequestSpec("GET", f"/v1/jobs/{job_id}/report")))

    def _events(self, job_id: str, read_timeout: float | None) -> Iterator[ServerSentEvent | None]:
        """The job's SSE stream, decoded (None for each keep-alive comment). Raises ``APIStatusError`` if the
        server will not stream."""
        # No retries here: when the stream cannot be had, waiting falls back to polling instead.
        spec = RequestSpec("GET", f"/v1/jobs/{job_id}/events", headers={"Accept": "text/event-stream"},
                           max_retries=0)
        t = self.timeout
        timeout = t if read_timeout is None else httpx.Timeout(connect=t.connect, read=read_timeout,
                                                               write=t.write, pool=t.pool)
        response = self._request(spec, stream=True, timeout=timeout)
        try:
            if not response.headers.get("content-type", "").startswith("text/event-stream"):
                raise APIStatusError("the server did not answer with text/event-stream",
                                     status=response.status_code)
            decoder = SSEDecoder()
            for line in response.iter_lines():
                event = decoder.feed(line)
                if event is not None:
                    yield event
                elif line.startswith(":"):
                    yield None  # a keep-alive comment: the waiter's clock moves on
        except httpx.TransportError as e:
            raise self._transport_error(e) from e
        finally:
            response.close()

    def _download(self, job_id: str, path: str | os.PathLike[str], expected: str | None,
                  progress: ProgressArg, file: str | None = None) -> Path:
        """Stream the artifact into ``path.part`` (resuming it with Range), check sha256, rename. The parent
        folders are made; a ``path`` that is a folder is a ValidationError (it names the file to write)."""
        dst = prepare_destination(Path(path), job_id)
        part = part_path(dst)
        attempt = 0
        restarted = False
        while True:
            resuming = part.exists() and part.stat().st_size > 0
            try:
                return self._download_once(job_id, dst, part, expected, progress, file)
            except (APIConnectionError, StorageBusy) as e:
                if attempt >= self.max_retries:
                    raise
                after = e.retry_after if isinstance(e, StorageBusy) else None
                self._sleep(self.retry.delay(attempt, None, self._rand, retry_after=after))
                attempt += 1
            except ChecksumMismatch:
                if not resuming or restarted:
                    raise
                restarted = True  # a partial file left by something else: removed, the whole artifact once more

    def _from_storage(self, url: str, part: Path, have: int) -> tuple[httpx.Response, int]:
        """GET a presigned storage URL (a 307 of a download) without the API's headers, resuming from ``have``;
        a 416 (the partial file no longer fits) starts over. Returns the streaming response and ``have``."""
        for _ in range(2):
            request = self._http.build_request("GET", url, headers=storage_request_headers(have))
            try:
                response = self._http.send(request, stream=True)
            except httpx.TransportError as e:
                raise self._transport_error(e) from e
            if response.status_code == 416 and have:
                response.close()
                part.unlink(missing_ok=True)
                have = 0
                continue
            if response.status_code >= 300:
                response.close()
                raise storage_error(response)
            return response, have
        raise APIStatusError("the artifact's storage refused the download", status=416)

    def _download_once(self, job_id: str, dst: Path, part: Path, expected: str | None,
                       progress: ProgressArg, file: str | None = None) -> Path:
        have = part.stat().st_size if part.exists() else 0
        try:
            response = self._request(self._spec_download(job_id, have, expected, file), stream=True)
        except APIStatusError as e:
            if e.status != 416 or not have:
                raise
            part.unlink()  # the partial file does not fit the artifact any more: start over
            have = 0
            response = self._request(self._spec_download(job_id, 0, expected, file), stream=True)
        want = expected or etag_sha256(response)
        location = redirect_location(response)
        if location is not None:  # the storage serves the bytes (a presigned URL); the ETag came from the API
            response.close()
            response, have = self._from_storage(location, part, have)
        try:
            if response.status_code == 206 and content_range_start(response) == have:
                digest, done = hash_existing(part)
                mode = "ab"
            else:
                digest, done, mode = hashlib.sha256(), 0, "wb"
            length = response.headers.get("content-length")
            reporter = Reporter(progress, f"download {dst.name}", done + int(length) if length else None)
            reporter.set(done)
            try:
                with open(part, mode) as f:
                    for chunk in response.iter_bytes():
                        f.write(chunk)
                        digest.update(chunk)
                        reporter.update(len(chunk))
            except httpx.TransportError as e:
                raise self._transport_error(e) from e  # the .part stays: the next attempt resumes it
            finally:
                reporter.close()
        finally:
            response.close()
        got = digest.hexdigest()
        if want and got != want:
            part.unlink(missing_ok=True)
            raise ChecksumMismatch(f"artifact of job {job_id}: sha256 {got} != expected {want}; file removed",
                                   request_id=self.last_request_id)
        os.replace(part, dst)
        return dst
