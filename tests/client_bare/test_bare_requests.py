"""Retries (connection errors, 429/503 with Retry-After, never other 4xx), idempotency keys,
client-side config validation, streamed multipart uploads, auth and User-Agent headers."""

from __future__ import annotations

import io
import json
from email.parser import BytesParser
from email.policy import HTTP
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from bare_helpers import Api, FakeTime, job_json, problem

from quantd_client import _exceptions as ex
from quantd_client import _upload
from quantd_client._base import RequestSpec, RetryPolicy

INFO = {"version": "1", "devices": [], "dtypes": [], "observers": [], "methods": [], "granularities": [],
        "input_formats": [], "output_formats": [],
        "limits": {"max_upload_bytes": 1, "max_sync_bytes": 1, "max_queue": 1}}


def parse_multipart(request: httpx.Request) -> dict[str, tuple[str | None, bytes]]:
    """name -> (filename, content) of a multipart body, with the stdlib parser."""
    raw = b"Content-Type: " + request.headers["content-type"].encode() + b"\r\n\r\n" + request.content
    msg = BytesParser(policy=HTTP).parsebytes(raw)
    out: dict[str, tuple[str | None, bytes]] = {}
    for part in msg.iter_parts():
        payload = part.get_payload(decode=True)
        out[part.get_param("name", header="content-disposition")] = (part.get_filename(), payload)
    return out


class Script:
    """Answers requests from a list of responses/exceptions, recording what was sent."""

    def __init__(self, *steps: Any) -> None:
        self.steps = list(steps)
        self.requests: list[httpx.Request] = []
        self.bodies: list[bytes] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        self.bodies.append(request.read())
        step = self.steps.pop(0)
        if isinstance(step, Exception):
            raise step
        return step


def test_retries_connection_errors_then_succeeds(api: Api) -> None:
    t = FakeTime()
    s = Script(httpx.ConnectError("refused"), httpx.ReadTimeout("slow"), httpx.Response(200, json=INFO))
    assert api.call(api.client(s, t), "info").version == "1"
    assert len(s.requests) == 3
    assert t.sleeps == [0.5, 1.0]  # base 0.5·2^attempt, jitter pinned at its top


def test_connection_errors_exhaust_retries(api: Api) -> None:
    t = FakeTime()
    s = Script(*[httpx.ConnectError("refused")] * 3)
    with pytest.raises(ex.APIConnectionError):
        api.call(api.client(s, t, max_retries=2), "info")
    assert len(s.requests) == 3 and len(t.sleeps) == 2


def test_429_honours_retry_after_seconds_and_503_backs_off(api: Api) -> None:
    t = FakeTime()
    s = Script(httpx.Response(429, headers={"Retry-After": "7"}, json={"title": "t", "status": 429, "detail": "d"}),
               problem(503), httpx.Response(200, json=INFO))
    api.call(api.client(s, t), "info")
    assert t.sleeps == [7.0, 1.0]


def test_retry_after_is_capped_and_final_429_raises_rate_limited(api: Api) -> None:
    t = FakeTime()
    s = Script(*[httpx.Response(429, headers={"Retry-After": "100000"},
                                json={"title": "t", "status": 429, "detail": "d"})] * 2)
    with pytest.raises(ex.RateLimited) as info:
        api.call(api.client(s, t, max_retries=1), "info")
    assert t.sleeps == [RetryPolicy().max_retry_after]
    assert info.value.retry_after == 100000.0


@pytest.mark.parametrize("status", [400, 401, 404, 409, 413, 415, 422, 500])
def test_never_retries_other_statuses(api: Api, status: int) -> None:
    t = FakeTime()
    s = Script(problem(status), httpx.Response(200, json=INFO))
    with pytest.raises(ex.APIStatusError):
        api.call(api.client(s, t), "info")
    assert len(s.requests) == 1 and t.sleeps == []


def test_backoff_is_exponential_jittered_and_capped() -> None:
    p = RetryPolicy(base_delay=0.5, max_delay=4.0)
    assert [p.delay(a, rand=lambda: 1.0) for a in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert [p.delay(a, rand=lambda: 0.0) for a in range(4)] == [0.25, 0.5, 1.0, 2.0]


def test_idempotency_key_reused_across_retries_and_new_per_submit(api: Api, tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    f.write_bytes(b"x" * 1000)
    s = Script(httpx.ConnectError("x"), problem(503), httpx.Response(202, json=job_json("a")),
               httpx.Response(202, json=job_json("b")))
    c = api.client(s)
    assert api.call(c, "submit", f, {"scheme": {"dtype": "int8"}}).id == "a"
    assert api.call(c, "submit", f, {"scheme": {"dtype": "int8"}}).id == "b"
    keys = [r.headers["idempotency-key"] for r in s.requests]
    assert keys[0] == keys[1] == keys[2] and keys[3] != keys[0]
    # every attempt re-sent the whole file from disk
    for req, body in zip(s.requests, s.bodies, strict=True):
        parts = parse_multipart(httpx.Request("POST", "http://x", headers=req.headers, content=body))
        assert parts["file"] == ("m.safetensors", b"x" * 1000)
        assert json.loads(parts["config"][1])["scheme"]["dtype"] == "int8"


def test_explicit_idempotency_key_is_sent(api: Api, tmp_path: Path) -> None:
    f = tmp_path / "m.npy"
    np.save(f, np.zeros(3, np.float32))
    s = Script(httpx.Response(202, json=job_json()))
    api.call(api.client(s), "submit", f, {}, idempotency_key="k-123")
    assert s.requests[0].headers["idempotency-key"] == "k-123"


def test_invalid_config_dict_rejected_before_sending(api: Api) -> None:
    s = Script()
    c = api.client(s)
    with pytest.raises(ex.ValidationError) as info:
        api.call(c, "quantize", np.zeros((4, 4), np.float32), {"scheme": {"dtype": "int5"}})
    assert info.value.status is None and "dtype" in info.value.detail
    assert isinstance(info.value, ValueError)
    with pytest.raises(ex.ValidationError, match="symmetric"):
        api.call(c, "quantize", np.zeros((4, 4), np.float32), {"scheme": {"dtype": "uint4", "symmetric": True}})
    assert s.requests == []


def test_quantize_array_sends_npy_and_returns_artifact_with_summary(api: Api) -> None:
    summary = {"tensors_quantized": 1, "tensors_skipped": 0, "input_bytes": 64, "output_bytes": 12,
               "compression_ratio": 5.3, "bits_per_weight": 6.0, "mean_sqnr_db": 30.0, "min_sqnr_db": 30.0,
               "worst_tensor": "w", "elapsed_s": 0.01, "device": "cpu"}
    s = Script(httpx.Response(200, content=b"ARTIFACT", headers={"Quantd-Summary": json.dumps(summary),
                                                                  "x-request-id": "r9"}))
    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    art = api.call(api.client(s, api_key="sekret"), "quantize", x, {"scheme": {"dtype": "int8"}}, name="w")
    assert art.data == b"ARTIFACT" and art.request_id == "r9"
    assert art.summary is not None and art.summary.worst_tensor == "w"
    req = s.requests[0]
    assert req.url.path == "/v1/quantize"
    assert req.headers["authorization"] == "Bearer sekret"
    assert req.headers["user-agent"].startswith("quantd-python/")
    assert int(req.headers["content-length"]) == len(s.bodies[0])
    parts = parse_multipart(httpx.Request("POST", "http://x", headers=req.headers, content=s.bodies[0]))
    fname, payload = parts["file"]
    assert fname == "w.npy"
    np.testing.assert_array_equal(np.load(io.BytesIO(payload), allow_pickle=False), x)


def test_dict_of_arrays_is_sent_as_npz_without_pickle(api: Api) -> None:
    s = Script(httpx.Response(200, json={"tensors": []}))
    arrays = {"a.weight": np.ones((2, 8), np.float32), "b": np.arange(4, dtype=np.float16)}
    api.call(api.client(s), "analyze", arrays, [{"dtype": "int8"}, {"dtype": "int4", "group_size": 4}])
    req = s.requests[0]
    parts = parse_multipart(httpx.Request("POST", "http://x", headers=req.headers, content=s.bodies[0]))
    assert parts["file"][0] == "tensors.npz"
    with np.load(io.BytesIO(parts["file"][1]), allow_pickle=False) as z:
        assert sorted(z.files) == ["a.weight", "b"]
        np.testing.assert_array_equal(z["b"], arrays["b"])
    configs = json.loads(parts["configs"][1])
    assert [c["dtype"] for c in configs] == ["int8", "int4"] and configs[1]["group_size"] == 4


def test_object_arrays_refused() -> None:
    with pytest.raises(ex.ValidationError, match="pickle"):
        _upload.make_file_part(np.array([object()], dtype=object))


def test_api_key_from_environment(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTD_API_KEY", "from-env-key")
    s = Script(httpx.Response(200, json=INFO))
    api.call(api.client(s), "info")
    assert s.requests[0].headers["authorization"] == "Bearer from-env-key"


def test_path_upload_is_streamed_in_chunks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The body is produced chunk by chunk from disk: no read ever asks for the whole file."""
    monkeypatch.setattr(_upload, "CHUNK_SIZE", 1000)
    f = tmp_path / "big.bin"
    f.write_bytes(bytes(range(256)) * 40)  # 10240 bytes
    reads: list[int] = []
    real_open = open

    class Spy(io.FileIO):
        def read(self, n: int = -1) -> bytes:
            reads.append(n)
            return super().read(n)

    monkeypatch.setattr("builtins.open", lambda p, mode="r", *a, **k: Spy(p, "rb") if Path(p) == f
                        else real_open(p, mode, *a, **k))
    part = _upload.make_file_part(f)
    body = _upload.MultipartBody({"config": "{}"}, [part])
    sent: list[int] = []
    chunks = list(body.iter_bytes(sent.append))
    assert reads and all(0 < n <= 1000 for n in reads)
    assert sum(sent) == body.content_length == len(b"".join(chunks))
    assert sum(1 for c in chunks if len(c) == 1000) == 10  # the file went out as 10 chunks of 1000


def test_non_seekable_stream_is_not_retried(api: Api) -> None:
    class OneShot(io.RawIOBase):
        def __init__(self) -> None:
            self.data = io.BytesIO(b"abc" * 10)

        def readable(self) -> bool:
            return True

        def seekable(self) -> bool:
            return False

        def readinto(self, b: Any) -> int:
            chunk = self.data.read(len(b))
            b[:len(chunk)] = chunk
            return len(chunk)

    c = api.client(Script())
    one_shot = _upload.FilePart("file", "s.bin", 30, stream=OneShot())
    spec = RequestSpec("POST", "/v1/analyze", body=_upload.MultipartBody({}, [one_shot]))
    assert not spec.replayable
    assert c._retry_delay(spec, 0, response=problem(503)) is None
    assert c._retry_delay(spec, 0, error=httpx.ConnectError("x")) is None
    with pytest.raises(ex.ValidationError, match="non-seekable"):
        _upload.make_file_part(OneShot())


def test_seekable_stream_replays_from_its_start(api: Api) -> None:
    t = FakeTime()
    buf = io.BytesIO(b"HEADxyz")
    buf.read(4)
    s = Script(problem(503), httpx.Response(200, json={"tensors": []}))
    api.call(api.client(s, t), "analyze", buf, [{"dtype": "int8"}], name="s.npy")
    assert len(s.requests) == 2
    for req, body in zip(s.requests, s.bodies, strict=True):
        parts = parse_multipart(httpx.Request("POST", "http://x", headers=req.headers, content=body))
        assert parts["file"] == ("s.npy", b"xyz")


def test_upload_progress_callback_counts_every_byte(api: Api, tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    f.write_bytes(b"z" * 5000)
    seen: list[tuple[float, float | None]] = []
    s = Script(httpx.Response(202, json=job_json()))
    api.call(api.client(s), "submit", f, {}, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1][0] == seen[-1][1] == len(s.bodies[0])
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
