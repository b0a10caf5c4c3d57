"""Job handles: SSE parsing, wait (events, polling fallback, timeout), paging, cancel, report, and
resumable, sha256-checked downloads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from bare_helpers import Api, FakeTime, job_json, problem, sha, summary_json

from quantd_client import _exceptions as ex
from quantd_client._base import SSEDecoder


def decode(text: str) -> list[tuple[str, str, str | None]]:
    d = SSEDecoder()
    out = []
    for line in text.splitlines():
        ev = d.feed(line)
        if ev is not None:
            out.append((ev.event, ev.data, ev.id))
    return out


def test_sse_decoder() -> None:
    text = (": keep-alive\n\n"
            "event: progress\ndata: {\"fraction\": 0.5}\n\n"
            "id: 7\ndata: line1\ndata:line2\n\n"
            "event: succeeded\r\ndata: {}\r\n\r\n"
            "event: ignored-no-blank-line\ndata: x\n")
    assert decode(text) == [("progress", '{"fraction": 0.5}', None), ("message", "line1\nline2", "7"),
                            ("succeeded", "{}", "7")]


def sse(*events: tuple[str, Any]) -> httpx.Response:
    import json

    body = "".join(f"event: {e}\ndata: {json.dumps(d)}\n\n" for e, d in events)
    return httpx.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})


class JobServer:
    """A scripted jobs API: /events answers from ``events``; GET job walks through ``statuses``."""

    def __init__(self, events: httpx.Response | Exception | None, statuses: list[str]) -> None:
        self.events = events
        self.statuses = statuses
        self.paths: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        if request.url.path.endswith("/events"):
            if isinstance(self.events, Exception):
                raise self.events
            return self.events or problem(404)
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        done = status == "succeeded"
        return httpx.Response(200, json=job_json("j1", status, fraction=1.0 if done else 0.25,
                                                 sha="a" * 64 if done else None))


def handle(api: Api, server: JobServer, t: FakeTime) -> Any:
    c = api.client(server, t)
    return api.call(c, "get_job", "j1")


def test_wait_follows_events(api: Api) -> None:
    t = FakeTime()
    server = JobServer(sse(("progress", {"fraction": 0.5}), ("progress", {"progress": {"fraction": 0.9}}),
                           ("succeeded", {})), ["queued", "succeeded"])
    fracs: list[float] = []
    job = handle(api, server, t)
    job = api.call(job, "wait", progress=lambda d, _t: fracs.append(d))
    assert job.status == "succeeded" and job.result.artifact_sha256 == "a" * 64
    assert fracs == [0.5, 0.9, 1.0]
    assert server.paths == ["/v1/jobs/j1", "/v1/jobs/j1/events", "/v1/jobs/j1"]
    assert t.sleeps == []


@pytest.mark.parametrize("events", [lambda: None, lambda: httpx.ConnectError("no"),
                                    lambda: httpx.Response(200, json={"not": "sse"}),
                                    lambda: sse(("progress", {"fraction": 0.1}))])  # ends without a verdict
def test_wait_falls_back_to_polling_with_backoff(api: Api, events: Any) -> None:
    t = FakeTime()
    server = JobServer(events(), ["queued", "running", "running", "running", "succeeded"])
    job = api.call(handle(api, server, t), "wait")
    assert job.status == "succeeded"
    assert t.sleeps == [0.5, 0.75, 1.125]  # poll backoff ×1.5 from 0.5 s
    assert server.paths.count("/v1/jobs/j1") == 5


def test_wait_timeout_raises_job_timeout(api: Api) -> None:
    t = FakeTime()
    server = JobServer(None, ["running"])
    job = handle(api, server, t)
    with pytest.raises(ex.JobTimeout):
        api.call(job, "wait", timeout=2.0)
    assert sum(t.sleeps) == pytest.approx(2.0)


def test_wait_does_not_hide_auth_errors(api: Api) -> None:
    t = FakeTime()
    server = JobServer(problem(401), ["running"])
    job = handle(api, server, t)
    with pytest.raises(ex.AuthError):
        api.call(job, "wait")


def test_wait_on_failed_job_returns_its_error(api: Api) -> None:
    def h(request: httpx.Request) -> httpx.Response:
        body = job_json("j1", "failed")
        body["error"] = {"type": "urn:x", "title": "Config cannot apply", "detail": "tensor 'w': group_size"}
        return httpx.Response(200, json=body)

    job = api.call(api.client(h), "get_job", "j1")
    job = api.call(job, "wait")
    assert job.status == "failed" and "group_size" in job.error.detail


def test_list_jobs_pages_lazily(api: Api) -> None:
    seen: list[dict[str, str]] = []

    def h(request: httpx.Request) -> httpx.Response:
        q = dict(request.url.params)
        seen.append(q)
        page = {None: (["a", "b"], "c1"), "c1": (["c", "d"], "c2"), "c2": (["e"], None)}[q.get("cursor")]
        return httpx.Response(200, json={"items": [job_json(i, "succeeded") for i in page[0]],
                                         "next_cursor": page[1]})

    c = api.client(h)
    assert [j.id for j in api.collect(c.list_jobs(status="succeeded"))] == ["a", "b", "c", "d", "e"]
    assert [s.get("cursor") for s in seen] == [None, "c1", "c2"]
    assert all(s["status"] == "succeeded" for s in seen)
    seen.clear()
    assert [j.id for j in api.collect(c.list_jobs(limit=3))] == ["a", "b", "c"]
    assert [s["limit"] for s in seen] == ["3", "1"] and len(seen) == 2


def test_cancel_and_report(api: Api) -> None:
    report = {"job_id": "j1", "config": {}, "summary": summary_json(),
              "tensors": [{"name": "w", "shape": [4, 4], "in_dtype": "F32", "scheme": None, "stats": None,
                           "skipped": True, "reason": "1-D"}]}

    def h(request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            return httpx.Response(200, json=job_json("j1", "cancelled"))
        if request.url.path.endswith("/report"):
            return httpx.Response(200, json=report)
        return httpx.Response(200, json=job_json("j1", "running"))

    c = api.client(h)
    assert api.call(c, "cancel", "j1").status == "cancelled"
    job = api.call(c, "get_job", "j1")
    assert api.call(job, "report").tensors[0].name == "w"
    assert api.call(job, "cancel").status == "cancelled"


ART = bytes(range(256)) * 64  # 16 KiB


class ArtifactServer:
    """Serves ART honouring ``Range: bytes=N-``; can drop the connection after ``cut`` bytes once."""

    def __init__(self, *, etag: str | None = None, ignore_range: bool = False, cut: int | None = None,
                 body: bytes = ART) -> None:
        self.etag = etag if etag is not None else sha(body)
        self.ignore_range = ignore_range
        self.cut = cut
        self.body = body
        self.ranges: list[str | None] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if not request.url.path.endswith("/artifact"):
            return httpx.Response(200, json=job_json("j1", "succeeded", sha=sha(ART), nbytes=len(ART)))
        rng = request.headers.get("range")
        self.ranges.append(rng)
        start = int(rng[6:-1]) if rng and not self.ignore_range else 0
        if start >= len(self.body) and rng:
            return problem(416)
        data = self.body[start:]
        headers = {"etag": f'"{self.etag}"', "content-length": str(len(data))}
        status = 200
        if start:
            status = 206
            headers["content-range"] = f"bytes {start}-{len(self.body) - 1}/{len(self.body)}"
        if self.cut is not None:
            cut, self.cut = self.cut, None
            return httpx.Response(status, headers=headers, stream=Broken(data[:cut]))
        return httpx.Response(status, headers=headers, content=data)


class Broken(httpx.SyncByteStream, httpx.AsyncByteStream):
    def __init__(self, head: bytes) -> None:
        self.head = head

    def __iter__(self) -> Any:
        yield self.head
        raise httpx.ReadError("connection reset")

    async def __aiter__(self) -> Any:
        yield self.head
        raise httpx.ReadError("connection reset")


def download(api: Api, server: ArtifactServer, dst: Path, t: FakeTime | None = None) -> Path:
    c = api.client(server, t)
    job = api.call(c, "get_job", "j1")
    return api.call(job, "download", dst, progress=False)


def test_download_fresh(api: Api, tmp_path: Path) -> None:
    server = ArtifactServer()
    dst = tmp_path / "out.safetensors"
    assert download(api, server, dst) == dst
    assert dst.read_bytes() == ART and not (tmp_path / "out.safetensors.part").exists()
    assert server.ranges == [None]


def test_download_resumes_existing_part_with_range(api: Api, tmp_path: Path) -> None:
    dst = tmp_path / "out.safetensors"
    (tmp_path / "out.safetensors.part").write_bytes(ART[:5000])
    server = ArtifactServer()
    download(api, server, dst)
    assert dst.read_bytes() == ART
    assert server.ranges == ["bytes=5000-"]


def test_download_resumes_after_connection_drop(api: Api, tmp_path: Path) -> None:
    t = FakeTime()
    server = ArtifactServer(cut=7000)
    dst = tmp_path / "out.safetensors"
    download(api, server, dst, t)
    assert dst.read_bytes() == ART
    assert server.ranges == [None, "bytes=7000-"] and len(t.sleeps) == 1


def test_download_restarts_when_server_ignores_range(api: Api, tmp_path: Path) -> None:
    dst = tmp_path / "out.safetensors"
    (tmp_path / "out.safetensors.part").write_bytes(b"garbage!" * 100)
    server = ArtifactServer(ignore_range=True)
    download(api, server, dst)
    assert dst.read_bytes() == ART


def test_download_restarts_after_416(api: Api, tmp_path: Path) -> None:
    dst = tmp_path / "out.safetensors"
    (tmp_path / "out.safetensors.part").write_bytes(b"x" * (len(ART) + 10))
    server = ArtifactServer()
    download(api, server, dst)
    assert dst.read_bytes() == ART and server.ranges == [f"bytes={len(ART) + 10}-", None]


def test_download_sha_mismatch_removes_file(api: Api, tmp_path: Path) -> None:
    dst = tmp_path / "out.safetensors"
    server = ArtifactServer(body=ART[:-1] + b"\x00")  # job says sha(ART); the bytes differ
    with pytest.raises(ex.ChecksumMismatch, match="sha256"):
        download(api, server, dst)
    assert not dst.exists() and not (tmp_path / "out.safetensors.part").exists()


def test_download_409_until_succeeded(api: Api, tmp_path: Path) -> None:
    def h(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/artifact"):
            return problem(409, "job j1 is running")
        return httpx.Response(200, json=job_json("j1", "running"))

    job = api.call(api.client(h), "get_job", "j1")
    with pytest.raises(ex.Conflict, match="running"):
        api.call(job, "download", tmp_path / "o")


def test_list_jobs_beyond_one_page_asks_for_full_pages(api: Api) -> None:
    # The server takes at most 100 a page: a larger limit is fetched as full pages.
    seen: list[int] = []

    def h(request: httpx.Request) -> httpx.Response:
        size = int(request.url.params["limit"])
        seen.append(size)
        if size > 100:
            return httpx.Response(422, json={"type": "urn:x", "title": "t", "status": 422, "detail": "limit ≤ 100"})
        start = int(request.url.params.get("cursor") or 0)
        return httpx.Response(200, json={"items": [job_json(f"j{i}", "succeeded") for i in range(start, start + size)],
                                         "next_cursor": str(start + size)})

    jobs = api.collect(api.client(h).list_jobs(limit=150))
    assert len(jobs) == 150 and jobs[-1].id == "j149"
    assert seen == [100, 50]


def test_wait_polls_through_a_server_restart(api: Api) -> None:
    """Each poll gives up after the client's retries (seconds); a restart takes longer, and the job lives on."""
    t = FakeTime()
    answers: list[Any] = ["running", *[httpx.ConnectError("refused")] * 30, *[problem(502)] * 20, "succeeded"]

    def h(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/events"):
            return problem(404)
        a = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(a, Exception):
            raise a
        if isinstance(a, httpx.Response):  # a proxy in front of the restarting server
            return a
        return httpx.Response(200, json=job_json("j1", a, fraction=1.0 if a == "succeeded" else 0.25,
                                                 sha="a" * 64 if a == "succeeded" else None))

    job = api.call(api.call(api.client(h, t), "get_job", "j1"), "wait", timeout=600)
    assert job.status == "succeeded"


def test_wait_gives_up_on_a_server_that_stays_away(api: Api) -> None:
    t = FakeTime()

    def h(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/events"):
            return problem(404)
        if t.now > 0:
            raise httpx.ConnectError("refused")
        return httpx.Response(200, json=job_json("j1", "running", fraction=0.25))

    job = api.call(api.client(h, t), "get_job", "j1")
    with pytest.raises(ex.JobTimeout):  # the documented error of a wait past its timeout
        api.call(job, "wait", timeout=60)
    assert t.now >= 60


def test_a_job_an_older_server_stored_with_a_nan_argument_is_still_read(api: Api) -> None:
    """The server serves such a NaN as null; the SDK shows the job rather than failing get, list and wait."""
    body = job_json("j1", "failed")
    body["config"] = {"scheme": {"dtype": "int4", "method": "gptq", "method_args": {"damp": None, "act_order": True}}}

    def h(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/jobs":
            return httpx.Response(200, json={"items": [body], "next_cursor": None})
        return httpx.Response(200, json=body)

    c = api.client(h)
    job = api.call(c, "get_job", "j1")
    assert job.model.config.scheme.method_args == {"damp": None, "act_order": True}


class KeepAlives(httpx.SyncByteStream, httpx.AsyncByteStream):
    """An event stream that only sends keep-alive comments, ``every`` seconds of ``t`` apart (at most ``n``)."""

    def __init__(self, t: FakeTime, every: float, n: int = 200) -> None:
        self.t, self.every, self.n = t, every, n

    def __iter__(self) -> Any:
        for _ in range(self.n):
            self.t.now += self.every
            yield b": keep-alive\n\n"

    async def __aiter__(self) -> Any:
        for chunk in self:
            yield chunk


@pytest.mark.parametrize("timeout", [3.0, 20.0, 44.0])
def test_wait_timeout_holds_while_the_stream_sends_only_keep_alives(api: Api, timeout: float) -> None:
    """A queued job sends no events, and each keep-alive resets the stream's read timeout: the wait still
    raises JobTimeout at its deadline (it leaves the stream when the next keep-alive would come too late)."""
    t = FakeTime()
    server = JobServer(httpx.Response(200, headers={"content-type": "text/event-stream"},
                                      stream=KeepAlives(t, every=15.0)), ["queued"])
    job = handle(api, server, t)
    with pytest.raises(ex.JobTimeout):
        api.call(job, "wait", timeout=timeout)
    assert timeout <= t.now <= max(timeout, 15.0 * (timeout // 15.0 + 1)) and t.now < timeout + 15.0


def test_download_follows_a_presigned_redirect_without_the_api_key(api: Api, tmp_path: Path) -> None:
    """With presigned downloads the API answers 307 (its ETag the artifact's sha256) and the storage serves the
    bytes: the client follows, resumes with Range there, starts over on the storage's 416, and sends the
    storage none of the API's headers."""
    storage_headers: list[httpx.Headers] = []

    def h(request: httpx.Request) -> httpx.Response:
        if request.url.host == "storage.test":
            storage_headers.append(request.headers)
            rng = request.headers.get("range")
            start = int(rng[6:-1]) if rng else 0
            if start >= len(ART):
                return httpx.Response(416)
            headers = {"etag": '"d41d8cd98f00b204e9800998ecf8427e"'}  # the store's own (an MD5), not a sha256
            if start:
                headers["content-range"] = f"bytes {start}-{len(ART) - 1}/{len(ART)}"
            return httpx.Response(206 if start else 200, headers=headers, content=ART[start:])
        if request.url.path.endswith("/artifact"):
            return httpx.Response(307, headers={"location": "http://storage.test/b/j1.safetensors?X-Amz-Signature=s",
                                                "etag": f'"{sha(ART)}"'})
        return httpx.Response(200, json=job_json("j1", "succeeded", sha=sha(ART), nbytes=len(ART)))

    c = api.client(h, api_key="secret-key")
    job = api.call(c, "get_job", "j1")
    for part, ranges in [(None, [None]), (ART[:5000], ["bytes=5000-"]), (b"x" * (len(ART) + 3), [f"bytes={len(ART) + 3}-", None])]:
        dst = tmp_path / f"out{len(storage_headers)}.safetensors"
        if part is not None:
            (tmp_path / f"{dst.name}.part").write_bytes(part)
        before = len(storage_headers)
        assert api.call(job, "download", dst, progress=False) == dst
        assert dst.read_bytes() == ART and not (tmp_path / f"{dst.name}.part").exists()
        assert [hd.get("range") for hd in storage_headers[before:]] == ranges
    assert all("authorization" not in hd and "idempotency-key" not in hd for hd in storage_headers)


@pytest.mark.parametrize("status", [403, 404])
def test_download_reports_the_storage_refusing_a_presigned_url(api: Api, tmp_path: Path, status: int) -> None:
    """A refusal (credentials, a bucket policy, a missing object) is raised at once, as the store's status."""
    seen: list[int] = []

    def h(request: httpx.Request) -> httpx.Response:
        if request.url.host == "storage.test":
            seen.append(status)
            return httpx.Response(status, content=b"<Error><Code>AccessDenied</Code></Error>")
        if request.url.path.endswith("/artifact"):
            return httpx.Response(307, headers={"location": "http://storage.test/b/x"})
        return httpx.Response(200, json=job_json("j1", "succeeded", sha=sha(ART), nbytes=len(ART)))

    job = api.call(api.client(h), "get_job", "j1")
    with pytest.raises(ex.APIStatusError, match=f"storage answered {status}") as e:
        api.call(job, "download", tmp_path / "o.safetensors", progress=False)
    assert e.value.status == status and not isinstance(e.value, ex.StorageBusy) and seen == [status]


def test_a_busy_storage_gets_a_new_url_from_the_api(api: Api, tmp_path: Path) -> None:
    """S3's 503 SlowDown or a 5xx: the download asks the API again (a fresh URL) after the store's Retry-After
    or the backoff, and succeeds; a store that stays busy ends it with StorageBusy (an APIStatusError)."""
    storage: list[tuple[int, dict[str, str]]] = [(503, {"retry-after": "7"}), (500, {}), (200, {})]
    urls: list[str] = []

    def h(request: httpx.Request) -> httpx.Response:
        if request.url.host == "storage.test":
            urls.append(str(request.url))
            status, headers = storage.pop(0) if storage else (503, {})
            return httpx.Response(status, headers=headers, content=ART if status == 200 else b"<Error/>")
        if request.url.path.endswith("/artifact"):
            return httpx.Response(307, headers={"location": f"http://storage.test/b/x?sig={len(urls)}",
                                                "etag": f'"{sha(ART)}"'})
        return httpx.Response(200, json=job_json("j1", "succeeded", sha=sha(ART), nbytes=len(ART)))

    t = FakeTime()
    job = api.call(api.client(h, t), "get_job", "j1")
    dst = tmp_path / "o.safetensors"
    assert api.call(job, "download", dst, progress=False) == dst and dst.read_bytes() == ART
    assert urls == [f"http://storage.test/b/x?sig={i}" for i in range(3)]
    assert t.sleeps[0] == 7.0 and len(t.sleeps) == 2  # the store's Retry-After, then the backoff
    with pytest.raises(ex.StorageBusy, match="storage answered 503") as e:
        api.call(job, "download", tmp_path / "again.safetensors", progress=False)
    assert isinstance(e.value, ex.APIStatusError) and e.value.status == 503


def test_download_into_a_folder_is_refused_and_missing_parents_are_made(api: Api, tmp_path: Path) -> None:
    server = ArtifactServer()
    with pytest.raises(ex.ValidationError, match="is a folder; name the file"):
        download(api, server, tmp_path)
    assert list(tmp_path.iterdir()) == [] and server.ranges == []  # nothing asked, nothing left behind
    dst = tmp_path / "new" / "deeper" / "out.safetensors"
    assert download(api, server, dst) == dst and dst.read_bytes() == ART
