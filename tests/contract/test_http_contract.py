"""CONTRACT §2/§3 from outside: a real server process and plain httpx, row by row."""

from __future__ import annotations

import hashlib
import io
import json
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ._harness import (
    KEY_A,
    KEY_B,
    TERMINAL,
    Server,
    assert_problem,
    st_decode,
    st_encode,
    start_server,
    stop_server,
    wait_job,
)

JOB_FIELDS = {"id", "status", "created_at", "started_at", "finished_at", "input", "config", "progress", "device",
              "result", "error"}
INPUT_FIELDS = {"filename", "bytes", "sha256", "format", "tensors"}
PROGRESS_FIELDS = {"tensors_done", "tensors_total", "bytes_done", "bytes_total", "fraction"}
SUMMARY_FIELDS = {"tensors_quantized", "tensors_skipped", "input_bytes", "output_bytes", "compression_ratio",
                  "bits_per_weight", "mean_sqnr_db", "min_sqnr_db", "worst_tensor", "elapsed_s", "device"}
STATS_FIELDS = {"numel", "mse", "mae", "max_abs_error", "sqnr_db", "cosine", "outlier_rate", "outlier_threshold",
                "clipped_fraction", "theoretical_max_error", "bits_per_weight", "compression_ratio"}
ALL_DTYPES = {"int8", "int4", "int3", "int2", "uint8", "uint4", "nf4", "fp8_e4m3", "fp8_e5m2", "float16",
              "bfloat16",
              # §9.2: ggml's block types, valid with output "gguf" only
              "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k"}
CONFIG = {"scheme": {"dtype": "int8", "granularity": "channel", "symmetric": True}}


def small_model(seed: int = 0, rows: int = 16, cols: int = 64) -> bytes:
    rng = np.random.default_rng(seed)
    return st_encode({"layer.weight": ("F32", rng.standard_normal((rows, cols)).astype(np.float32)),
                      "layer.bias": ("F32", rng.standard_normal(rows).astype(np.float32))})


def post_job(srv: Server, data: bytes, config: dict[str, Any] = CONFIG, *, filename: str = "m.safetensors",
             headers: dict[str, str] | None = None) -> dict[str, Any]:
    r = srv.client.post("/v1/jobs", files={"file": (filename, data)}, data={"config": json.dumps(config)},
                        headers=headers)
    assert r.status_code == 202, r.text[:500]
    job: dict[str, Any] = r.json()
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"
    return job


def quantize(srv: Server, data: bytes, filename: str, config: dict[str, Any] = CONFIG) -> Any:
    return srv.client.post("/v1/quantize", files={"file": (filename, data)}, data={"config": json.dumps(config)})


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A second server with API keys and tiny size limits."""
    srv = start_server(tmp_path_factory.mktemp("contract-guarded"), {
        "QUANTD_API_KEYS": f"tenant-a:{KEY_A},tenant-b:{KEY_B}",
        "QUANTD_MAX_SYNC_BYTES": "4096", "QUANTD_MAX_UPLOAD_BYTES": "65536"})
    yield srv
    stop_server(srv)


# ---- health, metrics, info ----

def test_health_ready_metrics(server: Server) -> None:
    c = server.client
    r = c.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert c.get("/readyz").status_code == 200
    quantize(server, small_model(), "m.safetensors")  # so request and bytes series have samples
    r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = dict(re.findall(r"^# TYPE (\S+) (\S+)$", r.text, flags=re.M))
    assert any("request" in n and t == "counter" for n, t in families.items()), families
    assert any(re.search("latenc|duration|seconds", n) and t == "histogram" for n, t in families.items()), families
    assert re.search(r'^quantd_jobs\w*\{[^}]*status="\w+"', r.text, flags=re.M), "jobs by status"
    assert re.search(r"^\w*queue\w*(\{[^}]*\})? \d", r.text, flags=re.M), "queue depth"
    bytes_line = re.search(r"^(\w*quantized_bytes\w*)(\{[^}]*\})? (\S+)$", r.text, flags=re.M)
    assert bytes_line and float(bytes_line.group(3)) > 0, "bytes quantized"


def test_info_names_every_field(server: Server) -> None:
    info = server.client.get("/v1/info").json()
    assert isinstance(info["version"], str) and info["version"]
    assert info["devices"] and all({"name", "type", "memory_bytes"} <= set(d) for d in info["devices"])
    assert set(info["dtypes"]) == ALL_DTYPES
    assert set(info["observers"]) >= {"minmax", "percentile", "meanstd", "ema", "mse", "entropy"}
    assert "rtn" in info["methods"]
    assert set(info["input_formats"]) >= {"safetensors", "pytorch", "npy", "npz"}
    assert "safetensors" in info["output_formats"]
    assert {"Q4_K_M", "Q3_K_M", "Q5_K_M", "Q6_K", "Q8_0"} <= set(info["gguf_mixes"])  # the mixes gguf_mix takes
    assert isinstance(info["limits"], dict) and info["limits"]


# ---- analyze, quantize, calibrate ----

def test_analyze_results_in_config_order(server: Server) -> None:
    schemes = [{"dtype": "int2", "granularity": "tensor", "symmetric": True},
               {"dtype": "int8", "granularity": "channel", "symmetric": True},
               {"dtype": "int4", "granularity": "group", "group_size": 32}]
    r = server.client.post("/v1/analyze", files={"file": ("m.safetensors", small_model())},
                           data={"configs": json.dumps(schemes)})
    assert r.status_code == 200, r.text
    tensors = r.json()["tensors"]
    weight = next(t for t in tensors if t["name"] == "layer.weight")
    assert weight["shape"] == [16, 64]
    assert [res["scheme"]["dtype"] for res in weight["results"]] == ["int2", "int8", "int4"]
    assert all(set(res["stats"]) >= STATS_FIELDS for res in weight["results"])
    sqnr = [res["stats"]["sqnr_db"] for res in weight["results"]]
    assert sqnr[0] < sqnr[2] < sqnr[1], sqnr  # 2 bits < 4 bits < 8 bits, so the order is real


def test_analyze_16_configs_ok_17_refused(server: Server) -> None:
    one = {"dtype": "int8", "granularity": "tensor", "symmetric": True}
    files = {"file": ("m.safetensors", small_model())}
    r = server.client.post("/v1/analyze", files=files, data={"configs": json.dumps([one] * 16)})
    assert r.status_code == 200 and len(r.json()["tensors"][0]["results"]) == 16
    r = server.client.post("/v1/analyze", files=files, data={"configs": json.dumps([one] * 17)})
    assert 400 <= r.status_code < 500
    assert_problem(r, r.status_code)


def test_quantize_artifact_and_summary_header(server: Server) -> None:
    r = quantize(server, small_model(), "m.safetensors")
    assert r.status_code == 200, r.text[:300]
    assert r.headers["content-type"].startswith("application/octet-stream")
    header = r.headers["quantd-summary"]
    summary = json.loads(header)
    assert header == json.dumps(summary, separators=(",", ":")), "compact JSON"
    assert set(summary) >= SUMMARY_FIELDS, SUMMARY_FIELDS - set(summary)
    assert summary["tensors_quantized"] == 1 and summary["tensors_skipped"] == 1
    assert summary["output_bytes"] == len(r.content)
    tensors, meta = st_decode(r.content)
    assert {"layer.weight.qdata", "layer.weight.scale", "layer.bias"} <= set(tensors)
    assert json.loads(meta["quantd"])["format_version"] == 1


def test_calibrate_layers(server: Server) -> None:
    rng = np.random.default_rng(1)
    acts = st_encode({"enc.0.act": ("F32", rng.standard_normal((32, 8)).astype(np.float32) * 3),
                      "enc.1.act": ("F32", rng.uniform(0, 2, (24, 4, 4)).astype(np.float32))})
    spec = {"dtype": "int8", "symmetric": False, "observer": "minmax", "observer_args": {}}
    r = server.client.post("/v1/calibrate", files={"file": ("acts.safetensors", acts)},
                           data={"observer": json.dumps(spec)})
    assert r.status_code == 200, r.text
    layers = {la["name"]: la for la in r.json()["layers"]}
    assert set(layers) == {"enc.0.act", "enc.1.act"}
    for la in layers.values():
        assert {"name", "min", "max", "scale", "zero_point", "observer", "num_samples"} <= set(la)
        assert la["observer"] == "minmax"
    assert layers["enc.0.act"]["num_samples"] == 32 and layers["enc.1.act"]["num_samples"] == 24
    la = layers["enc.1.act"]
    assert 0.0 <= la["min"] < 0.01 and 1.99 < la["max"] <= 2.0, la  # the observed range
    # affine int8 over a range widened to include 0
    assert la["scale"] == pytest.approx((max(la["max"], 0) - min(la["min"], 0)) / 255, rel=1e-3)


# ---- jobs ----

def test_job_lifecycle(server: Server) -> None:
    c = server.client
    data = small_model(3)
    job = post_job(server, data)
    assert set(job) >= JOB_FIELDS, JOB_FIELDS - set(job)
    assert set(job["input"]) >= INPUT_FIELDS and set(job["progress"]) >= PROGRESS_FIELDS
    assert job["input"]["sha256"] == hashlib.sha256(data).hexdigest() and job["input"]["bytes"] == len(data)
    assert job["input"]["format"] == "safetensors" and job["input"]["tensors"] == 2
    assert job["status"] in ("queued", "running", "succeeded")
    done = wait_job(c, job["id"])
    assert done["status"] == "succeeded", done
    assert done["device"] and done["started_at"] and done["finished_at"] and done["error"] is None
    result = done["result"]
    assert {"artifact_bytes", "artifact_sha256", "summary"} <= set(result)
    assert set(result["summary"]) >= SUMMARY_FIELDS

    report = c.get(f"/v1/jobs/{job['id']}/report").json()
    assert {"job_id", "config", "summary", "tensors"} <= set(report) and report["job_id"] == job["id"]
    rows = {t["name"]: t for t in report["tensors"]}
    for t in rows.values():
        assert {"name", "shape", "in_dtype", "scheme", "stats", "skipped", "reason"} <= set(t)
    assert rows["layer.bias"]["skipped"] and rows["layer.bias"]["reason"]
    assert not rows["layer.weight"]["skipped"] and set(rows["layer.weight"]["stats"]) >= STATS_FIELDS

    art = c.get(f"/v1/jobs/{job['id']}/artifact")
    assert art.status_code == 200
    digest = hashlib.sha256(art.content).hexdigest()
    assert art.headers["etag"].strip('"').removeprefix("W/").strip('"') == digest
    assert result["artifact_sha256"] == digest and result["artifact_bytes"] == len(art.content)
    part = c.get(f"/v1/jobs/{job['id']}/artifact", headers={"Range": "bytes=10-109"})
    assert part.status_code == 206 and part.content == art.content[10:110]
    assert part.headers["content-range"] == f"bytes 10-109/{len(art.content)}"

    with c.stream("GET", f"/v1/jobs/{job['id']}/events") as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        events = [line.split(":", 1)[1].strip() for line in s.iter_lines() if line.startswith("event:")]
    assert events and events[-1] == "succeeded" and sum(e in TERMINAL for e in events) == 1, events
    assert set(events[:-1]) <= {"progress"}, events


def test_job_list_order_cursor_and_filter(server: Server) -> None:
    c = server.client
    ids = [post_job(server, small_model(10 + i))["id"] for i in range(3)]
    for i in ids:
        wait_job(c, i)
    page = c.get("/v1/jobs", params={"limit": 2}).json()
    assert set(page) >= {"items", "next_cursor"}
    assert [j["id"] for j in page["items"]] == ids[::-1][:2]
    assert page["next_cursor"]
    nxt = c.get("/v1/jobs", params={"limit": 2, "cursor": page["next_cursor"]}).json()
    assert nxt["items"] and nxt["items"][0]["id"] == ids[0]
    created = [j["created_at"] for j in c.get("/v1/jobs", params={"limit": 100}).json()["items"]]
    assert created == sorted(created, reverse=True)
    ok = c.get("/v1/jobs", params={"status": "succeeded", "limit": 100}).json()["items"]
    assert ok and all(j["status"] == "succeeded" for j in ok)
    assert c.get("/v1/jobs", params={"status": "failed", "limit": 100}).json()["items"] == []


def test_report_409_before_success_and_delete(server: Server) -> None:
    c = server.client
    rng = np.random.default_rng(5)
    big = st_encode({f"l{i}.weight": ("F32", rng.standard_normal((512, 1024)).astype(np.float32))
                     for i in range(12)})
    job = post_job(server, big, {"scheme": {"dtype": "nf4", "granularity": "group", "group_size": 64,
                                            "observer": "mse"}})
    r = c.get(f"/v1/jobs/{job['id']}")
    if r.json()["status"] != "succeeded":
        assert_problem(c.get(f"/v1/jobs/{job['id']}/report"), 409)
        assert_problem(c.get(f"/v1/jobs/{job['id']}/artifact"), 409)
    d = c.delete(f"/v1/jobs/{job['id']}")
    assert d.status_code in (200, 202, 204), d.text
    end = wait_job(c, job["id"])
    assert end["status"] in ("cancelled", "succeeded")
    if end["status"] == "cancelled":
        assert_problem(c.get(f"/v1/jobs/{job['id']}/report"), (404, 409, 410))
        with c.stream("GET", f"/v1/jobs/{job['id']}/events") as s:
            events = [ln.split(":", 1)[1].strip() for ln in s.iter_lines() if ln.startswith("event:")]
        assert events[-1] == "cancelled" and sum(e in TERMINAL for e in events) == 1, events


# ---- problems, auth, limits ----

def test_problem_json_422_has_errors(server: Server) -> None:
    r = quantize(server, small_model(), "m.safetensors", {"scheme": {"dtype": "int5"}})
    body = assert_problem(r, 422)
    assert body["errors"] and all({"loc", "msg"} <= set(e) for e in body["errors"])
    assert_problem(server.client.get("/v1/jobs/does-not-exist"), 404)


@pytest.mark.parametrize(("scheme", "field", "names_tensor"), [
    ({"dtype": "int4", "granularity": "group", "group_size": 48}, "group_size", True),
    ({"dtype": "uint4", "symmetric": True}, "symmetric", False),
    ({"dtype": "fp8_e4m3", "symmetric": False}, "symmetric", False),
])
def test_config_that_cannot_apply_is_422(server: Server, scheme: dict[str, Any], field: str,
                                         names_tensor: bool) -> None:
    for path in ("/v1/quantize", "/v1/jobs"):
        r = server.client.post(path, files={"file": ("m.safetensors", small_model())},
                               data={"config": json.dumps({"scheme": scheme})})
        body = assert_problem(r, 422)
        text = body["detail"] + json.dumps(body.get("errors"))
        assert field in text, body
        if names_tensor:
            assert "layer.weight" in text, body


def test_auth_and_tenants(guarded: Server) -> None:
    c = guarded.client
    assert c.get("/healthz").status_code == 200
    assert_problem(c.get("/v1/info"), 401)
    assert_problem(c.get("/v1/jobs", headers={"Authorization": "Bearer wrong-key-123"}), 401)
    a = {"Authorization": f"Bearer {KEY_A}"}
    b = {"Authorization": f"Bearer {KEY_B}"}
    job = post_job(guarded, small_model(), headers=a)
    assert c.get(f"/v1/jobs/{job['id']}", headers=a).status_code == 200
    assert_problem(c.get(f"/v1/jobs/{job['id']}", headers=b), 404)
    assert_problem(c.get(f"/v1/jobs/{job['id']}/artifact", headers=b), 404)
    assert_problem(c.delete(f"/v1/jobs/{job['id']}", headers=b), 404)
    assert job["id"] not in [j["id"] for j in c.get("/v1/jobs", headers=b).json()["items"]]
    wait_job(c, job["id"], headers=a)


def test_413_sync_limit_points_to_jobs(guarded: Server) -> None:
    a = {"Authorization": f"Bearer {KEY_A}"}
    data = small_model(rows=32, cols=64)  # ~8.5 KB > 4096 sync limit, < 64 KiB upload limit
    r = guarded.client.post("/v1/quantize", files={"file": ("m.safetensors", data)},
                            data={"config": json.dumps(CONFIG)}, headers=a)
    body = assert_problem(r, 413)
    assert "/v1/jobs" in body["detail"], body
    post_job(guarded, data, headers=a)  # the same file is fine as a job
    huge = small_model(rows=128, cols=256)  # 130 KB > upload limit
    r = guarded.client.post("/v1/jobs", files={"file": ("m.safetensors", huge)},
                            data={"config": json.dumps(CONFIG)}, headers=a)
    assert_problem(r, 413)


# ---- §2 inputs ----

def test_safetensors_float_dtypes_and_integer_pass_through(server: Server) -> None:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((8, 32))
    data = st_encode({"w64": ("F64", w), "w32": ("F32", w.astype(np.float32)), "w16": ("F16", w.astype(np.float16)),
                      "wbf": ("BF16", w.astype(np.float32)), "ids": ("I32", np.arange(64, dtype=np.int32).reshape(8, 8))})
    r = quantize(server, data, "m.safetensors")
    assert r.status_code == 200, r.text
    tensors, meta = st_decode(r.content)
    info = json.loads(meta["quantd"])["tensors"]
    for n, orig in (("w64", "F64"), ("w32", "F32"), ("w16", "F16"), ("wbf", "BF16")):
        assert f"{n}.qdata" in tensors and info[n]["orig_dtype"].upper() in (orig, {
            "F64": "FLOAT64", "F32": "FLOAT32", "F16": "FLOAT16", "BF16": "BFLOAT16"}[orig])
    src, _ = st_decode(data)
    assert (tensors["ids"].dtype, tensors["ids"].raw) == ("I32", src["ids"].raw)


def test_pytorch_npy_npz_inputs(server: Server, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    w = np.random.default_rng(4).standard_normal((8, 32)).astype(np.float32)
    buf = io.BytesIO()
    torch.save({"fc.weight": torch.from_numpy(w), "fc.bias": torch.zeros(8)}, buf)
    r = quantize(server, buf.getvalue(), "model.pt")
    assert r.status_code == 200, r.text
    assert "fc.weight.qdata" in st_decode(r.content)[0]

    nb = io.BytesIO()
    np.save(nb, w, allow_pickle=False)
    r = quantize(server, nb.getvalue(), "proj_weight.npy")
    assert r.status_code == 200, r.text
    assert "proj_weight.qdata" in st_decode(r.content)[0]

    zb = io.BytesIO()
    np.savez(zb, a=w, b=w * 2)
    r = quantize(server, zb.getvalue(), "pair.npz")
    assert r.status_code == 200, r.text
    assert {"a.qdata", "b.qdata"} <= set(st_decode(r.content)[0])


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        import os

        return (os.system, (f"touch {self.marker}",))


def test_code_running_pickle_refused_never_executed(server: Server, tmp_path: Path) -> None:
    import pickle

    marker = tmp_path / "pwned"
    payload = pickle.dumps({"w": _Evil(str(marker))})
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(2, 2)}, buf)  # a real zip .pt container whose pickle we replace
    import zipfile

    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for item in src.infolist():
            z.writestr(item, payload if item.filename.endswith("data.pkl") else src.read(item))
    for blob in (out.getvalue(), payload):
        r = quantize(server, blob, "evil.pt")
        assert_problem(r, (415, 422))
    assert not marker.exists()


def test_junk_truncated_and_nan_are_4xx(server: Server) -> None:
    assert_problem(quantize(server, b"this is not a model at all" * 10, "m.safetensors"), 415)
    good = small_model()
    assert_problem(quantize(server, good[: len(good) // 2], "m.safetensors"), (400, 413, 415, 422))
    lying = json.dumps({"w": {"dtype": "F32", "shape": [4096, 4096], "data_offsets": [0, 64]}}).encode()
    r = quantize(server, struct.pack("<Q", len(lying)) + lying + bytes(64), "m.safetensors")
    assert "w" in assert_problem(r, (400, 415, 422))["detail"]
    bad = np.ones((8, 32), np.float32)
    bad[3, 5] = np.nan
    body = assert_problem(quantize(server, st_encode({"w": ("F32", bad)}), "m.safetensors"), (400, 422))
    assert "w" in body["detail"]
    bad[3, 5] = np.inf
    assert_problem(quantize(server, st_encode({"w": ("F32", bad)}), "m.safetensors"), (400, 422))


# ---- OpenAPI ----

def test_openapi_lists_every_endpoint(server: Server) -> None:
    spec = server.client.get("/openapi.json").json()
    paths = spec["paths"]
    want = {"/healthz": ["get"], "/readyz": ["get"], "/metrics": ["get"], "/v1/info": ["get"],
            "/v1/analyze": ["post"], "/v1/quantize": ["post"], "/v1/calibrate": ["post"],
            "/v1/jobs": ["post", "get"], "/v1/jobs/{job_id}": ["get", "delete"],
            "/v1/jobs/{job_id}/events": ["get"], "/v1/jobs/{job_id}/report": ["get"],
            "/v1/jobs/{job_id}/artifact": ["get"]}
    norm = {re.sub(r"\{[^}]+\}", "{job_id}", p): ops for p, ops in paths.items()}
    for path, methods in want.items():
        assert path in norm, (path, sorted(paths))
        for m in methods:
            op = norm[path][m]
            ok = {k: v for k, v in op["responses"].items() if k.startswith("2")}
            assert ok and all(v.get("content") or k == "204" for k, v in ok.items()), (path, m)
            if m == "post":
                body = op["requestBody"]["content"]["multipart/form-data"]["schema"]
                assert "file" in json.dumps(body), (path, body)
