"""POST /v1/jobs with QUANTD_QUANTIZE_DURING_UPLOAD: the model is quantized while it streams in, and the
job ends exactly as one quantized after the upload (same report, same artifact tensors)."""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import httpx
import pytest
import torch
from safetensors.torch import load

from quantd.server.settings import Settings

from .conftest import Harness, MakeServer, assert_problem, st_bytes

INT4 = {"scheme": {"dtype": "int4", "group_size": 32}}


def model_bytes() -> bytes:
    g = torch.Generator().manual_seed(5)
    return st_bytes({f"blocks.{i}.weight": torch.randn(32, 128, generator=g) * (i + 1) for i in range(3)}
                    | {"blocks.0.bias": torch.randn(32, generator=g)})


def runs(h: Harness) -> Any:
    prepared = h.app.state.quantd.jobs._prepared
    assert prepared is not None
    return prepared


async def finished_job(h: Harness, r: httpx.Response) -> tuple[dict[str, Any], dict[str, Any], bytes]:
    assert r.status_code == 202, r.text
    job = await h.wait_job(r.json()["id"])
    assert job["status"] == "succeeded", job
    report = (await h.client.get(f"/v1/jobs/{job['id']}/report")).json()
    artifact = (await h.client.get(f"/v1/jobs/{job['id']}/artifact")).content
    return job, report, artifact


async def test_a_job_quantized_during_its_upload_equals_one_quantized_after(make_server: MakeServer) -> None:
    data = model_bytes()
    async with make_server(quantize_during_upload="on") as h:
        job, report, artifact = await finished_job(h, await h.submit(data, config=INT4))
        assert runs(h).started == 1 and runs(h).adopted == 1
        assert not list(h.settings.tmp_dir.glob("run-*"))
        metrics = (await h.client.get("/metrics")).text
        assert 'quantd_upload_runs{outcome="adopted"} 1' in metrics, metrics
    async with make_server(quantize_during_upload="off", data_dir=h.settings.data_dir.parent / "off") as off:
        assert off.app.state.quantd.jobs._prepared is None
        job2, report2, artifact2 = await finished_job(off, await off.submit(data, config=INT4))
    assert [t["stats"] for t in report["tensors"]] == [t["stats"] for t in report2["tensors"]]
    assert job["progress"]["tensors_done"] == job["progress"]["tensors_total"] == 4
    assert job["result"]["summary"]["input_bytes"] == len(data) == job2["result"]["summary"]["input_bytes"]
    ours, theirs = load(artifact), load(artifact2)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


async def test_a_config_sent_after_the_file_is_quantized_after_the_upload(make_server: MakeServer) -> None:
    boundary = "quantd-test-boundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"m.safetensors\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n").encode() + model_bytes() + (
            f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"config\"\r\n\r\n{json.dumps(INT4)}"
            f"\r\n--{boundary}--\r\n").encode()
    async with make_server(quantize_during_upload="on") as h:
        r = await h.client.post("/v1/jobs", content=body,
                                headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
        await finished_job(h, r)
        assert runs(h).started == 0


@pytest.mark.parametrize("damage", ["truncated", "bad-config-for-a-tensor"])
async def test_a_refused_upload_leaves_no_run_behind(make_server: MakeServer, damage: str) -> None:
    data, config = model_bytes(), INT4
    if damage == "truncated":
        data = data[: len(data) - 1000]
    else:
        config = {"scheme": {"dtype": "int4", "group_size": 48}}  # 128 columns are not whole groups of 48
    async with make_server(quantize_during_upload="on") as h:
        r = await h.submit(data, config=config)
        assert_problem(r, 422)
        assert runs(h).started == 1
        assert [*runs(h)._unfiled, *runs(h)._filed.values()] == []  # discarded: cancelled, forgotten
        deadline = time.monotonic() + 10
        while list(h.settings.tmp_dir.glob("run-*")) and time.monotonic() < deadline:
            await anyio.sleep(0.05)  # the cancelled run deletes its artifact (and its .tmp) as it stops
        assert not list(h.settings.tmp_dir.glob("run-*"))
        # the server goes on: a good upload after it is quantized during its upload too
        await finished_job(h, await h.submit(model_bytes(), config=INT4))
        assert runs(h).adopted == 1


@pytest.mark.parametrize(("raw", "value"), [("on", "on"), ("1", "on"), ("true", "on"), ("OFF", "off"),
                                            ("0", "off"), ("auto", "auto")])
def test_quantize_during_upload_setting(monkeypatch: pytest.MonkeyPatch, raw: str, value: str) -> None:
    monkeypatch.setenv("QUANTD_QUANTIZE_DURING_UPLOAD", raw)
    assert Settings().quantize_during_upload == value


def test_quantize_during_upload_setting_refuses_junk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUANTD_QUANTIZE_DURING_UPLOAD", "sometimes")
    with pytest.raises(ValueError, match="quantize_during_upload"):
        Settings()


def test_auto_overlaps_on_cuda_workers_only() -> None:
    from quantd.jobs.config import room_to_overlap

    assert not room_to_overlap(["cpu"])
    assert room_to_overlap(["cuda:0"])
    assert room_to_overlap(["cuda:0", "cuda:1"])
