"""Health, readiness, info, metrics, problem+json for Starlette's own errors, request ids, OpenAPI."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import time
from collections.abc import Sequence

import pytest

from quantd.server.settings import GiB

from .conftest import CONFIG, KEY_A, assert_problem, st_bytes


async def test_healthz_and_readyz_with_an_embedded_worker(server):
    r = await server.client.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    r = await server.client.get("/readyz")
    assert r.status_code == 200, r.text
    checks = r.json()["checks"]
    assert checks == {"database": True, "storage": True, "workers": 1, "kernels": checks["kernels"],
                      "gguf_kernels": checks["gguf_kernels"]}
    # no warm-up in these tests: with kernels on, each scheme's first request builds them ("compiled" claimed
    # kernels that a 30-second first job was still building)
    assert checks["kernels"] in ("on demand", "eager")
    assert checks["gguf_kernels"] in ("compiled", "eager")  # compiled only with QUANTD_COMPILE=1


async def test_readyz_is_503_without_any_worker(make_server):
    async with make_server(workers=0) as h:
        body = assert_problem(await h.client.get("/readyz"), 503)
        assert "workers" in body["detail"]
        assert body["checks"]["database"] is True and body["checks"]["workers"] == 0


async def test_info_reports_limits_devices_and_capabilities(make_server):
    async with make_server(max_upload_bytes=3 * GiB, max_sync_bytes=1000, max_queue=7) as h:
        info = (await h.client.get("/v1/info")).json()
    assert info["limits"] == {"max_upload_bytes": 3 * GiB, "max_sync_bytes": 1000, "max_analyze_configs": 16,
                              "max_queue": 7}
    assert info["devices"][0]["name"] == "cpu" and info["devices"][0]["memory_bytes"] > 0
    assert "int4" in info["dtypes"] and "nf4" in info["dtypes"]
    assert "percentile" in info["observers"] and info["methods"][0] == "rtn"
    assert {"hqq", "gptq", "awq"} <= set(info["methods"])
    assert set(info["input_formats"]) == {"safetensors", "pytorch", "npy", "npz", "gguf"}
    assert info["auth"] is False


async def test_unknown_path_and_wrong_method_are_problems(server):
    body = assert_problem(await server.client.get("/v1/nope"), 404)
    assert "/v1/nope" in body["detail"]
    body = assert_problem(await server.client.put("/v1/info"), 405)
    assert "PUT" in body["detail"]


async def test_query_validation_is_a_422_problem_naming_the_parameter(server):
    body = assert_problem(await server.client.get("/v1/jobs", params={"limit": "0"}), 422)
    assert body["errors"][0]["loc"] == ["query", "limit"]
    body = assert_problem(await server.client.get("/v1/jobs", params={"status": "bogus"}), 422)
    assert "status" in body["detail"]


async def test_unhandled_error_is_a_clean_500_with_the_request_id(server, caplog):
    async def boom() -> None:
        raise RuntimeError("secret internals /etc/shadow")

    server.app.add_api_route("/boom", boom)
    with caplog.at_level(logging.ERROR, logger="quantd.server"):
        r = await server.client.get("/boom", headers={"X-Request-ID": "rid-123"})
    body = assert_problem(r, 500)
    assert "secret" not in r.text and body["request_id"] == "rid-123"
    assert r.headers["x-request-id"] == "rid-123"
    assert any(getattr(rec, "request_id", None) == "rid-123" and rec.exc_info for rec in caplog.records)
    assert (await server.client.get("/healthz")).status_code == 200


async def test_a_5xx_domain_error_does_not_leak_its_detail(server):
    from quantd.jobs.errors import StorageError

    async def storage_fault() -> None:
        raise StorageError("path '/srv/secret/x' is outside the data dir")

    server.app.add_api_route("/fault", storage_fault)
    r = await server.client.get("/fault")
    body = assert_problem(r, 500)
    assert "/srv/secret" not in r.text and body["type"] == "urn:quantd:storage-error"


async def test_request_id_is_generated_or_echoed_and_access_log_has_no_secrets(make_server, caplog):
    async with make_server(api_keys=f"a:{KEY_A}") as h:
        with caplog.at_level(logging.INFO, logger="quantd.access"):
            r1 = await h.client.get("/v1/info", headers={"Authorization": f"Bearer {KEY_A}"})
            r2 = await h.client.get("/healthz", headers={"X-Request-ID": "bad id with spaces"})
    assert r1.status_code == 200
    assert re.fullmatch(r"[0-9a-f]{32}", r1.headers["x-request-id"])
    assert re.fullmatch(r"[0-9a-f]{32}", r2.headers["x-request-id"])
    lines = [rec for rec in caplog.records if rec.name == "quantd.access"]
    assert {rec.path for rec in lines} >= {"/v1/info", "/healthz"}
    info_line = next(rec for rec in lines if rec.path == "/v1/info")
    assert info_line.status == 200 and info_line.method == "GET" and info_line.tenant == "a"
    assert info_line.duration_ms >= 0
    assert KEY_A not in caplog.text


async def test_metrics_exposition_counts_requests_by_route(server):
    await server.client.get("/healthz")
    await server.client.get("/v1/jobs/0123/report")
    text = (await server.client.get("/metrics")).text
    assert 'quantd_http_requests_total{method="GET",route="/healthz",status="200"} 1' in text
    assert 'quantd_http_requests_total{method="GET",route="/v1/jobs/{job_id}/report",status="404"} 1' in text
    assert re.search(r'quantd_http_request_duration_seconds_bucket\{method="GET",route="/healthz",le="\+Inf"\} 1', text)
    assert 'quantd_jobs{status="queued"} 0' in text
    assert "quantd_queue_depth 0" in text and "quantd_workers_busy 0" in text
    for line in text.splitlines():  # every sample line parses as name{labels} value
        if line and not line.startswith("#"):
            assert re.fullmatch(r'[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? [0-9.e+-]+|.* \+Inf', line), line


async def test_openapi_documents_multipart_bodies_and_problem_responses(server):
    spec = (await server.client.get("/openapi.json")).json()
    paths = spec["paths"]
    for p in ("/healthz", "/readyz", "/metrics", "/v1/info", "/v1/analyze", "/v1/quantize", "/v1/calibrate",
              "/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/events", "/v1/jobs/{job_id}/report",
              "/v1/jobs/{job_id}/artifact"):
        assert p in paths, p
    assert "delete" in paths["/v1/jobs/{job_id}"]
    body = paths["/v1/jobs"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert body["schema"]["properties"]["config"]["$ref"] == "#/components/schemas/QuantConfig"
    assert set(body["schema"]["required"]) == {"file", "config"}
    assert body["example"]
    post = paths["/v1/jobs"]["post"]["responses"]
    assert {"202", "408", "413", "415", "422", "429", "503", "507"} <= set(post)
    assert "application/problem+json" in post["422"]["content"]
    assert "Location" in post["202"]["headers"]
    assert post["202"]["content"]["application/json"]["example"]["status"] == "queued"
    assert post["202"]["content"]["application/json"]["schema"]["$ref"].endswith("/Job")
    art = paths["/v1/jobs/{job_id}/artifact"]["get"]["responses"]
    assert {"200", "206", "307", "409", "416"} <= set(art)
    assert {"Location", "ETag"} <= set(art["307"]["headers"])
    for route in ("/v1/quantize", "/v1/analyze", "/v1/calibrate"):  # an idle upload, a drain, a full disk
        assert {"408", "503", "507"} <= set(paths[route]["post"]["responses"]), route
    assert {"Quantd-Summary", "ETag", "Content-Disposition"} <= set(
        paths["/v1/quantize"]["post"]["responses"]["200"]["headers"])
    assert paths["/v1/analyze"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]["properties"][
        "configs"]["maxItems"] == 16
    for name in ("QuantConfig", "Scheme", "ObserverSpec", "Job", "Report"):
        assert name in spec["components"]["schemas"], name
    assert "HTTPValidationError" not in str(spec)


async def test_openapi_declares_the_bearer_scheme_only_when_keys_are_configured(make_server):
    async with make_server() as h:  # open: no key is asked for, and no 401 is ever answered
        spec = (await h.client.get("/openapi.json")).json()
    assert "securitySchemes" not in spec["components"]
    assert not any("security" in op or "401" in op["responses"] for ops in spec["paths"].values()
                   for op in ops.values())
    async with make_server(api_keys=f"a:{KEY_A}") as h:
        spec = (await h.client.get("/openapi.json")).json()
    assert spec["components"]["securitySchemes"]["apiKey"] == {
        "type": "http", "scheme": "bearer", "description": spec["components"]["securitySchemes"]["apiKey"]["description"]}
    paths = spec["paths"]
    assert paths["/v1/jobs"]["get"]["security"] == [{"apiKey": []}] and "security" not in paths["/healthz"]["get"]
    assert "401" in paths["/v1/jobs"]["get"]["responses"]


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/jobs/0123", "/v1/jobs/0123/artifact", "/healthz"])
async def test_options_lists_every_documented_method_of_the_resource(server, path):
    spec = (await server.client.get("/openapi.json")).json()
    template = {"/v1/jobs/0123": "/v1/jobs/{job_id}", "/v1/jobs/0123/artifact": "/v1/jobs/{job_id}/artifact"}
    documented = {m.upper() for m in spec["paths"][template.get(path, path)]}
    r = await server.client.options(path)
    assert r.status_code == 204 and r.content == b""
    assert set(r.headers["allow"].split(", ")) == documented | {"OPTIONS"}
    # Any other method: 405 naming them all (Starlette names only the first route's, e.g. GET without DELETE).
    r = await server.client.request("PATCH", path)
    assert_problem(r, 405)
    assert set(r.headers["allow"].split(", ")) == documented | {"OPTIONS"}


async def test_options_on_an_unknown_path_is_404(server):
    assert_problem(await server.client.options("/v1/nothing"), 404)


async def test_openapi_json_responses_have_examples_that_are_valid(server):
    """Every 2xx JSON response of every operation has an example, and it validates against the response's
    own schema (its quantd_client model)."""
    import quantd_client

    spec = (await server.client.get("/openapi.json")).json()
    checked = 0
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            for code, resp in op["responses"].items():
                media = resp.get("content", {}).get("application/json")
                if not code.startswith("2") or media is None or path in ("/healthz", "/readyz"):
                    continue
                assert "example" in media, (method, path, code)
                ref = media.get("schema", {}).get("$ref")
                if ref:
                    model = getattr(quantd_client, ref.rsplit("/", 1)[-1])
                    model.model_validate(media["example"])
                    checked += 1
    assert checked >= 8


@pytest.mark.parametrize("path", ["/healthz", "/metrics", "/readyz"])
async def test_ops_endpoints_need_no_key(make_server, path):
    async with make_server(api_keys=f"a:{KEY_A}") as h:
        assert (await h.client.get(path)).status_code == 200


@pytest.mark.parametrize("warmup", [True, False])
async def test_kernel_warm_up_starts_with_the_app_when_enabled(make_server, monkeypatch, warmup):
    from quantd import runtime

    started: list[int] = []
    monkeypatch.setattr(runtime, "start_warm_up", lambda activity=None, gguf=True, devices=(): started.append(1))
    async with make_server(warmup=warmup) as server:
        assert (await server.client.get("/healthz")).status_code == 200
    assert started == ([1] if warmup else [])


async def test_the_gguf_kernels_are_warmed_only_for_cpu_engines(make_server, monkeypatch):
    """GGUF's compiled k-quant kernels run on CPU tensors only: a server whose workers and synchronous
    endpoints all use CUDA does not build them."""
    import quantd.jobs
    import quantd.server.app
    from quantd import runtime

    ggufs: list[bool] = []
    monkeypatch.setattr(runtime, "start_warm_up", lambda activity=None, gguf=True, devices=(): ggufs.append(gguf))
    async with make_server(warmup=True) as server:  # CPU
        assert (await server.client.get("/healthz")).status_code == 200
    async with make_server(warmup=True, warmup_gguf=False) as server:
        assert (await server.client.get("/healthz")).status_code == 200
    monkeypatch.setattr(quantd.server.app, "sync_device", lambda device: "cuda:0")
    monkeypatch.setattr(quantd.jobs, "worker_devices", lambda config: ["cuda:0", "cuda:1"])
    async with make_server(warmup=True) as server:  # stands for a GPU host
        assert (await server.client.get("/healthz")).status_code == 200
    assert ggufs == [True, False, False]


async def test_requests_run_eager_while_the_warm_up_builds_the_kernels(make_server, monkeypatch, caplog):
    """The warm-up holds the compiled kernels: a request meanwhile runs eager instead of waiting on a
    compile, /readyz says so, and the log says when the warm-up starts and ends."""
    import threading

    import anyio
    import torch

    import quantd.io.outputs.gguf
    import quantd.io.pipeline
    from quantd.engine.ggml._common import KQUANT_KERNELS
    from quantd.engine.kernels import KERNELS

    from .conftest import CONFIG, st_bytes

    gate, building = threading.Event(), threading.Event()

    def slow_warm_up(devices: Sequence[str] = ("cpu",)) -> float:
        """Stands for compiling: holds the kernels until the test lets it finish."""
        assert KERNELS.wants(torch.empty(1 << 20))  # the warm-up's own thread takes them
        building.set()
        assert gate.wait(60)
        return 0.5

    gguf_gate, gguf_building = threading.Event(), threading.Event()

    def slow_gguf_warm_up() -> float:  # the GGUF phase: the other kernels are free meanwhile
        from quantd.engine.ggml._common import building_kernels

        with building_kernels():
            gguf_building.set()
            assert gguf_gate.wait(60)
        return 0.5

    calls: list[str] = []
    real_call = KERNELS.call
    monkeypatch.setattr(quantd.io.pipeline, "warm_up", slow_warm_up)
    monkeypatch.setattr(quantd.io.outputs.gguf, "warm_up_gguf", slow_gguf_warm_up)
    monkeypatch.setattr(KQUANT_KERNELS, "built", threading.Event())
    monkeypatch.setattr(KERNELS, "call", lambda name, *a, **k: calls.append(name) or real_call(name, *a, **k))
    monkeypatch.setattr("quantd.engine.kernels.MIN_ELEMENTS", 0)  # the request's small tensor would take them
    KERNELS.reset(available=True)
    try:
        with caplog.at_level(logging.INFO, logger="quantd.runtime"):
            async with make_server(warmup=True) as server:
                assert await anyio.to_thread.run_sync(building.wait, 60)
                ready = await server.client.get("/readyz")
                assert ready.status_code == 200 and ready.json()["checks"]["kernels"] == "warming"
                w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
                r = await server.client.post("/v1/quantize", data={"config": json.dumps(CONFIG)},
                                             files={"file": ("m.safetensors", st_bytes({"w": w}),
                                                             "application/octet-stream")})
                assert r.status_code == 200, r.text
                assert calls == []  # answered on the eager path, no compiled kernel asked for
                assert not KERNELS.wants(torch.empty(1 << 20))  # not this thread's while the warm-up holds them
                gate.set()
                assert await anyio.to_thread.run_sync(gguf_building.wait, 60)
                checks = (await server.client.get("/readyz")).json()["checks"]
                assert checks["kernels"] == "compiled" and checks["gguf_kernels"] == "warming", checks
                assert KERNELS.wants(torch.empty(1 << 20))  # jobs take the other kernels meanwhile
                gguf_gate.set()
                deadline = time.monotonic() + 60
                while not KQUANT_KERNELS.built.is_set() and time.monotonic() < deadline:
                    await anyio.sleep(0.05)  # poll under a deadline
                assert (await server.client.get("/readyz")).json()["checks"]["gguf_kernels"] == "compiled"
                while time.monotonic() < deadline and not any(  # the thread logs just after the flag is set
                        rec.getMessage() == "GGUF k-quant kernels ready" for rec in caplog.records):
                    await anyio.sleep(0.05)
    finally:
        gate.set()
        gguf_gate.set()
        KERNELS.reset()
    messages = [rec.getMessage() for rec in caplog.records if rec.name == "quantd.runtime"]
    assert messages[0].startswith("kernel warm-up started") and "compiled kernels ready" in messages
    assert "GGUF k-quant kernels ready" in messages


async def test_the_warm_up_builds_once_no_api_request_is_in_flight(make_server, monkeypatch):
    """The first requests to a new server do not compete with the warm-up: it begins building once no API
    request has been in flight for a quiet moment; probes (/readyz) do not count as requests."""
    import threading

    import anyio

    import quantd.io.pipeline
    from quantd import runtime
    from quantd.engine.kernels import KERNELS

    began = threading.Event()
    activities: list[runtime.RequestActivity] = []
    real_start = runtime.start_warm_up

    def start(activity: runtime.RequestActivity | None = None, gguf: bool = True,
              devices: Sequence[str] = ("cpu",)) -> runtime.WarmUp:
        assert activity is not None
        activity.enter()  # stands for a request in flight from the start
        activities.append(activity)
        return real_start(activity, gguf=False, devices=devices)

    monkeypatch.setattr(runtime, "WARM_UP_QUIET_S", 0.3)
    monkeypatch.setattr(runtime, "start_warm_up", start)
    monkeypatch.setattr(quantd.io.pipeline, "warm_up", lambda devices=(): began.set() or 0.0)
    KERNELS.reset(available=True)
    try:
        async with make_server(warmup=True) as server:
            (activity,) = activities
            await anyio.sleep(1.0)
            assert not began.is_set() and activity.quiet_for() == 0.0  # waits while a request is in flight
            activity.leave()
            assert (await server.client.get("/v1/info")).status_code == 200  # an API request: counted
            assert activity.quiet_for() < 0.3
            deadline = time.monotonic() + 30
            while not began.is_set() and time.monotonic() < deadline:
                quiet = activity.quiet_for()
                assert (await server.client.get("/readyz")).status_code == 200
                assert activity.quiet_for() >= quiet  # a probe is not a request in flight
                await anyio.sleep(0.05)
            assert began.is_set()
    finally:
        KERNELS.reset()


@pytest.mark.parametrize(("code", "status", "kind"), [
    (errno.ENOSPC, 507, "urn:quantd:storage-full"),
    (errno.EROFS, 503, "urn:quantd:storage-unavailable"),
])
async def test_the_servers_storage_failing_under_an_upload_is_a_problem_to_retry(server, monkeypatch, code, status,
                                                                                 kind):
    """A full or read-only data dir under an upload: 507/503 with Retry-After, no server path, not a bare 500."""
    from quantd.server import uploads

    def failing_open(*args, **kwargs):
        raise OSError(code, os.strerror(code), "/srv/quantd/data/tmp/upload-x")

    monkeypatch.setattr(uploads, "open", failing_open, raising=False)
    r = await server.client.post("/v1/jobs", files={"file": ("m.safetensors", st_bytes(), "application/octet-stream")},
                                 data={"config": json.dumps(CONFIG)})
    body = assert_problem(r, status)
    assert body["type"] == kind and int(r.headers["retry-after"]) >= 1 and "/srv/" not in body["detail"]


async def test_a_stopping_server_answers_uploads_503_and_claims_no_more_jobs(make_server):
    """SIGTERM during an upload: it was cut after the 30 s graceful timeout with a plain 500, and the
    embedded worker went on claiming jobs accepted meanwhile."""
    import asyncio
    import json

    from .conftest import CONFIG, assert_problem, st_bytes

    async with make_server() as h:
        jobs = h.app.state.quantd.jobs
        sent_some = asyncio.Event()

        async def body():
            yield (b'--B\r\nContent-Disposition: form-data; name="config"\r\n\r\n' + json.dumps(CONFIG).encode()
                   + b'\r\n--B\r\nContent-Disposition: form-data; name="file"; filename="m.safetensors"\r\n\r\n')
            for _ in range(200):
                yield b"\0" * 65536
                sent_some.set()
                await asyncio.sleep(0.01)

        upload = asyncio.create_task(h.client.post("/v1/jobs", content=body(),
                                                   headers={"Content-Type": "multipart/form-data; boundary=B"}))
        await sent_some.wait()
        jobs.begin_shutdown()  # what the server's signal handler calls
        r = await asyncio.wait_for(upload, 10)
        problem = assert_problem(r, 503)
        assert r.headers["retry-after"] == "5" and "shutting down" in problem["detail"]
        assert list(h.settings.tmp_dir.glob("upload-*")) == []
        jobs.draining = False  # a submit that completed before the signal: accepted, and left queued
        r = await h.submit(st_bytes())
        assert r.status_code == 202
        await asyncio.sleep(1.0)
        assert (await h.client.get(f"/v1/jobs/{r.json()['id']}")).json()["status"] == "queued"


async def test_a_local_storage_url_other_than_the_data_dir_takes_uploads(make_server, tmp_path):
    """``QUANTD_STORAGE_URL=file:///PATH`` (CONTRACT §11) apart from the data dir: uploads are streamed into the
    storage's own scratch folder, which it adopts them from, and the files land under PATH."""
    store = tmp_path / "elsewhere"
    async with make_server(storage_url=f"file://{store.as_posix()}") as h:
        r = await h.submit(st_bytes())
        assert r.status_code == 202, r.text
        job = await h.wait_job(r.json()["id"])
        assert job["status"] == "succeeded", job
        art = await h.client.get(f"/v1/jobs/{job['id']}/artifact")
        assert art.status_code == 200 and len(art.content) == job["result"]["artifact_bytes"]
        parts = [("file", ("config.json", b"{}")), ("file", ("model.safetensors", st_bytes()))]
        r = await h.client.post("/v1/jobs", files=parts, data={"config": json.dumps(CONFIG)})
        assert r.status_code == 202, r.text
        assert (await h.wait_job(r.json()["id"]))["status"] == "succeeded"
    assert any((store / "artifacts").iterdir())
