"""Hostile and broken inputs: each a quick 4xx problem, nothing executed, nothing written outside
the data dir, the server alive after; oversize uploads cut off while they stream."""

from __future__ import annotations

import asyncio
import io
import json
import os
import struct
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from quantd.server.uploads import sanitize_filename

from .conftest import CONFIG, assert_problem, npy_bytes, pt_bytes, st_bytes


class Boom:
    def __reduce__(self):
        return (os.system, (f"touch {Path.cwd() / 'PWNED-by-pickle'}",))


def _bad_header_len() -> bytes:
    return struct.pack("<Q", 2**62) + b"{}"


def _offsets_past_end() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}).encode()
    return struct.pack("<Q", len(header)) + header + b"\0" * 16


def _lying_shape() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [1000, 1000], "data_offsets": [0, 64]}}).encode()
    return struct.pack("<Q", len(header)) + header + b"\0" * 64


def _deep_json_header() -> bytes:
    body = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return struct.pack("<Q", len(body)) + body


def _gguf_string_alignment() -> bytes:
    def s(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    kv = s("general.alignment") + struct.pack("<I", 8) + s("32")
    tensor = s("w.weight") + struct.pack("<I2QIQ", 2, 32, 2, 0, 0)
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + kv + tensor
    return head + bytes(-len(head) % 32) + bytes(256)


def _surrogate_name() -> bytes:
    """A tensor name with a lone surrogate (JSON's ``\\ud800`` escape): no UTF-8 report or file can hold it."""
    header = json.dumps({"w\ud800": {"dtype": "F32", "shape": [4, 16], "data_offsets": [0, 256]}}).encode()
    return struct.pack("<Q", len(header)) + header + bytes(256)


def _npy_negative_dim() -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": (-1, 64)})
    return buf.getvalue() + bytes(256)


HOSTILE = {
    "pickle-that-runs-code": (pt_bytes({"w": Boom()}), "evil.pt", {415, 422}),
    "huge-header-length": (_bad_header_len(), "m.safetensors", {413, 415, 422}),
    "offsets-past-end": (_offsets_past_end(), "m.safetensors", {415, 422}),
    "shape-lies-about-bytes": (_lying_shape(), "m.safetensors", {415, 422}),
    "truncated": (st_bytes()[:-100], "m.safetensors", {415, 422}),
    "junk": (b"hello, I am not a model" * 10, "m.safetensors", {415}),
    "empty": (b"", "m.safetensors", {400, 415, 422}),
    "deeply-nested-header-json": (_deep_json_header(), "m.safetensors", {422}),
    "gguf-alignment-as-a-string": (_gguf_string_alignment(), "m.gguf", {422}),
    "meta-device-tensor": (pt_bytes({"w": torch.empty(64, 64, device="meta")}), "m.pt", {422}),
    "longdouble-npy": (npy_bytes(np.zeros((4, 4), np.longdouble)), "w.npy", {415}),
    "negative-npy-dim": (_npy_negative_dim(), "w.npy", {422}),
    "surrogate-tensor-name": (_surrogate_name(), "m.safetensors", {422}),
    "surrogate-state-dict-key": (pt_bytes({"w\ud800": torch.ones(4, 16)}), "m.pt", {422}),
}
NAN_MODEL = st_bytes({"w": torch.tensor([[1.0, float("nan")], [float("inf"), 0.0]]).repeat(2, 4)})


@pytest.mark.parametrize("endpoint", ["/v1/quantize", "/v1/jobs"])
@pytest.mark.parametrize("case", list(HOSTILE))
async def test_hostile_file_is_a_quick_4xx(server, endpoint, case):
    data, name, allowed = HOSTILE[case]
    t0 = time.monotonic()
    r = await server.client.post(endpoint, files={"file": (name, data, "application/octet-stream")},
                                 data={"config": json.dumps(CONFIG)})
    assert time.monotonic() - t0 < 10
    assert r.status_code in allowed, (r.status_code, r.text)
    assert_problem(r, r.status_code)
    assert not (Path.cwd() / "PWNED-by-pickle").exists()
    assert list(server.settings.tmp_dir.glob("upload-*")) == []
    assert (await server.client.get("/healthz")).status_code == 200


async def test_a_surrogate_tensor_name_is_a_422_on_every_endpoint(server):
    """It was a 500 on analyze and calibrate, an artifact no reader takes from quantize, and a job that ran
    three times before it failed as 'worker lost' (its report could not be written)."""
    data = _surrogate_name()
    for endpoint, form in (("/v1/analyze", {"configs": json.dumps([CONFIG["scheme"]])}),
                           ("/v1/calibrate", {"observer": json.dumps({"dtype": "int8", "observer": "minmax"})}),
                           ("/v1/quantize", {"config": json.dumps(CONFIG)}),
                           ("/v1/jobs", {"config": json.dumps(CONFIG)})):
        r = await server.client.post(endpoint, files={"file": ("m.safetensors", data, "x/y")}, data=form)
        body = assert_problem(r, 422)
        assert "'w\\ud800'" in body["detail"] and "lone surrogate" in body["detail"], (endpoint, body)


@pytest.mark.parametrize("endpoint", ["/v1/quantize", "/v1/jobs"])
async def test_an_empty_upload_says_the_file_is_empty(server, endpoint):
    r = await server.client.post(endpoint, files={"file": ("m.safetensors", b"", "application/octet-stream")},
                                 data={"config": json.dumps(CONFIG)})
    body = assert_problem(r, 422)
    assert "the file is empty" in body["detail"] and "first bytes" not in body["detail"]


@pytest.mark.parametrize("name, data", [
    ("m.safetensors", NAN_MODEL),
    ("m.pt", pt_bytes({"w": torch.tensor([[1.0, float("nan")], [float("inf"), 0.0]]).repeat(2, 4)})),
    ("w.npy", npy_bytes(np.array([[1.0, np.inf], [0.0, 2.0]], np.float32).repeat(4, 1))),
], ids=["safetensors", "pytorch", "npy"])
async def test_non_finite_weights_are_a_422_before_a_job_exists(server, name, data):
    """CONTRACT §2: the sync routes quantize at once; a job's upload is checked before it is accepted (a
    safetensors file while it streams)."""
    for endpoint in ("/v1/quantize", "/v1/jobs"):
        r = await server.client.post(endpoint, files={"file": (name, data, "x/y")}, data={"config": json.dumps(CONFIG)})
        body = assert_problem(r, 422)
        assert body["type"] == "urn:quantd:non-finite" and "'w'" in body["detail"], (endpoint, body)
    assert (await server.client.get("/v1/jobs")).json()["items"] == []


async def test_a_non_finite_tensor_the_job_leaves_as_it_is_is_refused_too(server):
    """CONTRACT §2: NaN/Inf weights are a 4xx, a norm or bias kept as it is included (a model with a NaN norm
    gives NaN outputs); integer tensors are not looked at."""
    data = st_bytes({"w": torch.randn(8, 64), "keep": torch.tensor([float("nan"), 1.0]),
                     "ids": torch.arange(4, dtype=torch.int64)})
    config = {**CONFIG, "rules": [{"match": "keep", "skip": True}]}
    for endpoint in ("/v1/jobs", "/v1/quantize"):
        r = await server.client.post(endpoint, files={"file": ("m.safetensors", data, "x/y")},
                                     data={"config": json.dumps(config)})
        body = assert_problem(r, 422)
        assert body["type"] == "urn:quantd:non-finite" and "'keep'" in body["detail"], (endpoint, body)
    data = st_bytes({"w": torch.randn(8, 64), "keep": torch.tensor([2.0, 1.0]), "ids": torch.arange(4)})
    r = await server.client.post("/v1/jobs", files={"file": ("m.safetensors", data, "x/y")},
                                 data={"config": json.dumps(config)})
    assert r.status_code == 202, r.text
    assert (await server.wait_job(r.json()["id"]))["status"] == "succeeded"


async def test_non_finite_weights_the_worker_finds_fail_the_job_saying_why(server, monkeypatch):
    """Inputs the submit does not scan (a GGUF file, a source by reference) are checked by the worker."""
    from quantd.server.routes import jobs as jobs_routes

    monkeypatch.setattr(jobs_routes, "check_finite", lambda *a, **k: None)
    r = await server.submit(NAN_MODEL)
    assert r.status_code == 202
    job = await server.wait_job(r.json()["id"])
    assert job["status"] == "failed" and job["error"]["type"] == "urn:quantd:non-finite"
    assert "'w'" in job["error"]["detail"]
    for what in ("artifact", "report"):  # a client that only downloads learns why, not just "is failed"
        body = assert_problem(await server.client.get(f"/v1/jobs/{job['id']}/{what}"), 409)
        assert "is failed" in body["detail"] and job["error"]["detail"] in body["detail"]


@pytest.mark.parametrize("config, loc", [
    ("{not json", ["body", "config"]),
    (json.dumps({"scheme": {"dtype": "int4"}, "surprise": 1}), ["body", "config", "surprise"]),
    (json.dumps({"scheme": {"dtype": "int4", "group_size": 0}}), ["body", "config", "scheme", "group_size"]),
    (json.dumps({"scheme": {"dtype": "uint4", "symmetric": True}}), ["body", "config", "scheme", "symmetric"]),
    (json.dumps({"scheme": {"dtype": "fp8_e4m3", "symmetric": False}}), ["body", "config", "scheme", "symmetric"]),
    (json.dumps({"scheme": {"dtype": "int4", "observer": "percentile", "observer_args": {"percentile": 150}}}),
     ["body", "config", "scheme", "observer_args", "percentile"]),
    (json.dumps([1, 2]), ["body", "config"]),
    (json.dumps({"scheme": {"dtype": "int8"}, "rules": [{"match": "x*", "scheme": {"dtype": "uint8", "symmetric": True}}]}),
     ["body", "config", "rules", 0, "scheme", "symmetric"]),
    (json.dumps({"rules": [{"match": "x*", "skip": True, "scheme": {"dtype": "int8"}}]}),
     ["body", "config", "rules", 0]),
])
async def test_bad_config_is_a_422_naming_the_field(server, config, loc):
    for endpoint in ("/v1/quantize", "/v1/jobs"):
        r = await server.client.post(endpoint, files={"file": ("m.safetensors", st_bytes(), "x/y")},
                                     data={"config": config})
        body = assert_problem(r, 422)
        assert body["errors"][0]["loc"][:len(loc)] == loc, body
        assert "Value error" not in r.text and "pydantic.dev" not in r.text  # our messages, not pydantic's dressing
        if "symmetric" in config:  # a scheme-level error says which tensors it concerns
            assert "every tensor that no rule matches" in body["detail"] or "tensors matching 'x*'" in body["detail"]


async def test_malformed_multipart_bodies(server):
    r = await server.client.post("/v1/jobs", content=b"not multipart", headers={"Content-Type": "text/plain"})
    assert_problem(r, 415)
    r = await server.client.post("/v1/jobs", data={"config": json.dumps(CONFIG)})  # no file part
    assert_problem(r, 415)  # urlencoded, not multipart
    r = await server.client.post("/v1/jobs", files={"other": ("x", b"1", "x/y")}, data={"config": "{}"})
    body = assert_problem(r, 400)
    assert "other" in body["detail"]
    r = await server.client.post("/v1/jobs", files={"file": ("m.safetensors", st_bytes(), "x/y")})
    body = assert_problem(r, 422)  # a required field missing: as FastAPI answers it
    assert "config" in body["detail"] and body["errors"] == [{"loc": ["body", "config"], "msg": "Field required"}]
    r = await server.client.post("/v1/quantize", data={"config": json.dumps(CONFIG)}, files={"x": ("a", b"", "x/y")})
    assert_problem(r, 400)  # an unknown part
    r = await server.client.post("/v1/analyze", files={"configs": (None, "[]", "application/json")})
    assert assert_problem(r, 422)["errors"] == [{"loc": ["body", "file"], "msg": "Field required"}]
    r = await server.client.post("/v1/jobs", content=b"--b\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nab",
                                 headers={"Content-Type": "multipart/form-data; boundary=b"})
    assert_problem(r, 400)  # the body ends inside a part
    assert list(server.settings.tmp_dir.glob("upload-*")) == []


@pytest.mark.parametrize("raw, clean", [
    ("../../etc/passwd.npy", "passwd.npy"), ("..\\..\\boot.ini", "boot.ini"), ("/abs/path/m.pt", "m.pt"),
    ("a\x00b\nc.npy", "abc.npy"), ("..", "upload"), ("", "upload"), ('q"uote.pt', "q_uote.pt"),
])
def test_sanitize_filename(raw, clean):
    assert sanitize_filename(raw) == clean


async def test_path_traversal_filename_never_names_a_file(server, tmp_path):
    import numpy as np

    from .conftest import npy_bytes

    r = await server.submit(npy_bytes(np.ones((4, 8), np.float32)), filename="../../etc/passwd.npy")
    assert r.status_code == 202, r.text
    assert r.json()["input"]["filename"] == "passwd.npy"
    outside = [p for p in tmp_path.rglob("*passwd*")]
    assert outside == []  # not written anywhere under the test dir, data dir included


async def test_oversize_upload_is_cut_off_while_streaming(make_server):
    limit = 64 * 1024
    async with make_server(max_upload_bytes=limit, max_sync_bytes=limit) as h:
        sent = 0

        async def body():
            nonlocal sent
            yield b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.bin\"\r\n\r\n"
            for _ in range(10_000):  # would be 640 MiB; the server must stop reading long before
                chunk = b"\0" * 65536
                sent += len(chunk)
                yield chunk

        r = await h.client.post("/v1/jobs", content=body(),
                                headers={"Content-Type": "multipart/form-data; boundary=B"})
        body_ = assert_problem(r, 413)
        assert str(limit) in body_["detail"]
        assert sent < 64 * 65536  # stopped after about the limit plus the form allowance, not 640 MiB
        assert list(h.settings.tmp_dir.glob("upload-*")) == []

        # A declared Content-Length above the limit is refused before the body is read.
        r = await h.client.post("/v1/jobs", content=b"x" * 10,
                                headers={"Content-Type": "multipart/form-data; boundary=B",
                                         "Content-Length": str(10 * 1024 * 1024)})
        assert_problem(r, 413)
        assert (await h.client.get("/healthz")).status_code == 200


async def test_an_upload_that_stops_sending_is_dropped(server, monkeypatch):
    """A client that stops mid-body without closing held its temp file and connection for ever."""
    from quantd.server import uploads

    monkeypatch.setattr(uploads, "UPLOAD_IDLE_S", 0.5)

    async def body():
        yield (b'--B\r\nContent-Disposition: form-data; name="config"\r\n\r\n' + json.dumps(CONFIG).encode()
               + b'\r\n--B\r\nContent-Disposition: form-data; name="file"; filename="m.safetensors"\r\n\r\n')
        yield b"\0" * 65536
        await asyncio.sleep(30)  # stalls; the server must not wait this out
        yield b"\0"

    t0 = time.monotonic()
    r = await server.client.post("/v1/jobs", content=body(), headers={"Content-Type": "multipart/form-data; boundary=B"})
    assert time.monotonic() - t0 < 10
    assert "no bytes of the body arrived for 0.5 s" in assert_problem(r, 408)["detail"]
    assert list(server.settings.tmp_dir.glob("upload-*")) == []
    assert (await server.client.get("/v1/jobs")).json()["items"] == []


@pytest.mark.parametrize("endpoint, limit", [("/v1/jobs", "max_upload_bytes"), ("/v1/quantize", "max_sync_bytes")])
async def test_a_chunked_upload_gets_413_soon_after_the_file_passes_the_limit(make_server, endpoint, limit):
    """Without Content-Length the limit is known only as the bytes come: the 413 comes within a few chunks of
    the file passing it, not a 1 MiB batch later."""
    sent = 0

    async def body():
        nonlocal sent
        yield (b'--B\r\nContent-Disposition: form-data; name="config"\r\n\r\n' + json.dumps(CONFIG).encode()
               + b'\r\n--B\r\nContent-Disposition: form-data; name="file"; filename="m.safetensors"\r\n\r\n')
        for _ in range(500):  # 5 MB at most
            sent += 10_000
            yield b"\0" * 10_000

    async with make_server(**({"max_sync_bytes": 50_000} if limit == "max_sync_bytes" else
                               {"max_upload_bytes": 50_000, "max_sync_bytes": 50_000})) as h:
        r = await h.client.post(endpoint, content=body(), headers={"Content-Type": "multipart/form-data; boundary=B"})
        assert_problem(r, 413)
    assert sent <= 300_000, sent  # the batches in flight to the parser at most; it was over a MiB


def _npz_of_zeros(rows: int, cols: int) -> bytes:
    """One deflated float32 member of zeros: rows × cols × 4 bytes inflated, a thousandth of that stored."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf, zf.open("w.npy", "w") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (rows, cols)})
        row = bytes(cols * 4)
        for _ in range(rows):
            f.write(row)
    return buf.getvalue()


@pytest.mark.parametrize("endpoint, field, value", [
    ("/v1/quantize", "config", CONFIG),
    ("/v1/analyze", "configs", [CONFIG["scheme"]]),
    ("/v1/calibrate", "observer", {}),
])
async def test_npz_bomb_is_refused_by_the_sync_limit_before_inflating(make_server, endpoint, field, value):
    """A 32 MiB member deflated to ~33 KB, under a 4 MiB sync limit: 413 naming the member and the limit,
    at once (the member is never inflated), where it used to be inflated and quantized whole."""
    data = _npz_of_zeros(2048, 4096)
    limit = 4 * 1024 * 1024
    assert len(data) < limit // 16
    async with make_server(max_sync_bytes=limit, max_upload_bytes=limit) as h:
        t0 = time.monotonic()
        r = await h.client.post(endpoint, files={"file": ("bomb.npz", data, "application/octet-stream")},
                                data={field: json.dumps(value)})
        assert time.monotonic() - t0 < 5
        body = assert_problem(r, 413)
        assert "'w'" in body["detail"] and "33554432 bytes" in body["detail"] and str(limit) in body["detail"]
        assert "POST /v1/jobs" in body["detail"]  # where larger inputs go
        assert list(h.settings.tmp_dir.iterdir()) == []


async def test_npz_bomb_is_refused_by_the_upload_limit_before_a_job_is_accepted(make_server):
    """On POST /v1/jobs the upload limit bounds what the tensors unpack to: 413 naming the member, no job."""
    data = _npz_of_zeros(2048, 4096)
    limit = 4 * 1024 * 1024
    async with make_server(max_sync_bytes=limit, max_upload_bytes=limit) as h:
        r = await h.client.post("/v1/jobs", files={"file": ("bomb.npz", data, "application/octet-stream")},
                                data={"config": json.dumps({"scheme": {"dtype": "int8"}})})
        body = assert_problem(r, 413)
        assert "'w'" in body["detail"] and "33554432 bytes" in body["detail"]
        assert (await h.client.get("/v1/jobs")).json()["items"] == []



async def test_a_by_reference_body_names_the_refused_field_as_a_form_does(server):
    config = {"scheme": {"dtype": "int8"}, "rules": [{"match": "x*", "scheme": {"dtype": "uint8", "symmetric": True}}]}
    r = await server.client.post("/v1/jobs", json={"config": config, "source": "s3://b/in.safetensors",
                                                   "destination": "s3://b/out/"})
    assert assert_problem(r, 422)["errors"][0]["loc"] == ["body", "config", "rules", 0, "scheme", "symmetric"]
