"""Jobs over HTTP: submit → 202 + Location, follow (SSE), report, artifact (ETag, Range), list
with pagination, idempotency, cancel, queue full → 429."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json

import anyio
import pytest

from quantd_client._artifact import read_artifact

from .conftest import CONFIG, assert_problem, st_bytes


async def test_submit_follow_and_download(server):
    data = st_bytes()
    r = await server.submit(data, filename="../../model.safetensors")
    assert r.status_code == 202, r.text
    job = r.json()
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["input"] == {"filename": "model.safetensors", "bytes": len(data),
                            "sha256": hashlib.sha256(data).hexdigest(), "format": "safetensors", "tensors": 2}
    assert job["config"]["scheme"]["dtype"] == "int8"
    # Queued, it already shows the device an embedded worker will run it on and how many tensors it has.
    assert job["device"] == "cpu" and job["progress"]["tensors_total"] == 2

    async with server.client.stream("GET", f"/v1/jobs/{job['id']}/events") as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        text = (await resp.aread()).decode()
    events = [block for block in text.split("\n\n") if block.startswith("event:")]
    names = [b.split("\n")[0].removeprefix("event: ") for b in events]
    assert names[-1] == "succeeded" and set(names[:-1]) <= {"progress"}
    final = json.loads(events[-1].split("\n")[1].removeprefix("data: "))
    assert final["status"] == "succeeded" and final["id"] == job["id"]

    done = (await server.client.get(f"/v1/jobs/{job['id']}")).json()
    assert done["status"] == "succeeded" and done["result"]["summary"]["tensors_quantized"] == 1
    metrics = (await server.client.get("/metrics")).text.splitlines()
    assert f"quantd_quantized_bytes_total {len(data)}" in metrics  # jobs count as bytes quantized too

    rep = (await server.client.get(f"/v1/jobs/{job['id']}/report")).json()
    assert rep["job_id"] == job["id"]
    by_name = {t["name"]: t for t in rep["tensors"]}
    assert by_name["layer.bias"]["skipped"] and not by_name["layer.weight"]["skipped"]
    assert by_name["layer.weight"]["stats"]["sqnr_db"] > 30  # int8 per channel on Gaussian weights

    r = await server.client.get(f"/v1/jobs/{job['id']}/artifact")
    assert r.status_code == 200
    art = r.content
    sha = hashlib.sha256(art).hexdigest()
    assert sha == done["result"]["artifact_sha256"] and r.headers["etag"] == f'"{sha}"'
    assert int(r.headers["content-length"]) == len(art) == done["result"]["artifact_bytes"]
    assert "layer.weight" in read_artifact(art).dequantize()

    r = await server.client.get(f"/v1/jobs/{job['id']}/artifact", headers={"Range": "bytes=10-19"})
    assert r.status_code == 206 and r.content == art[10:20]
    assert r.headers["content-range"] == f"bytes 10-19/{len(art)}"
    r = await server.client.get(f"/v1/jobs/{job['id']}/artifact", headers={"Range": "bytes=-5"})
    assert r.status_code == 206 and r.content == art[-5:]
    r = await server.client.get(f"/v1/jobs/{job['id']}/artifact", headers={"Range": f"bytes={len(art) - 3}-"})
    assert r.status_code == 206 and r.content == art[-3:]
    r = await server.client.get(f"/v1/jobs/{job['id']}/artifact", headers={"Range": f"bytes={len(art)}-"})
    assert_problem(r, 416)
    assert r.headers["content-range"] == f"bytes */{len(art)}"
    r = await server.client.get(f"/v1/jobs/{job['id']}/artifact", headers={"If-None-Match": f'"{sha}"'})
    assert r.status_code == 304 and r.content == b""
    for if_match, status in (('"nope"', 412), (f'W/"{sha}"', 412), (f'"x", "{sha}"', 200), ("*", 200)):
        r = await server.client.get(f"/v1/jobs/{job['id']}/artifact", headers={"If-Match": if_match})
        assert r.status_code == status, (if_match, r.status_code)  # RFC 9110: strong comparison, 412 otherwise
        assert status == 200 or r.headers["etag"] == f'"{sha}"'
    r = await server.client.get(f"/v1/jobs/{job['id']}/artifact",
                                headers={"Range": "bytes=0-3", "If-Range": '"stale"'})
    assert r.status_code == 200 and r.content == art  # If-Range mismatch → the whole file
    r = await server.client.head(f"/v1/jobs/{job['id']}/artifact")  # download tools probe with HEAD
    assert r.status_code == 200 and r.content == b"" and r.headers["etag"] == f'"{sha}"'
    assert int(r.headers["content-length"]) == len(art) and r.headers["accept-ranges"] == "bytes"
    r = await server.client.head(f"/v1/jobs/{job['id']}/artifact", headers={"Range": "bytes=10-19"})
    assert r.status_code == 206 and r.content == b"" and r.headers["content-range"] == f"bytes 10-19/{len(art)}"

    # DELETE of a finished job deletes its files: the job stays, its artifact is gone.
    r = await server.client.delete(f"/v1/jobs/{job['id']}")
    assert r.status_code == 200 and r.json()["status"] == "succeeded"
    assert_problem(await server.client.get(f"/v1/jobs/{job['id']}/artifact"), 410)
    leftovers = [p for p in server.settings.data_dir.rglob("*") if p.is_file() and job["id"] in p.name]
    assert leftovers == []


async def test_report_and_artifact_are_409_until_succeeded_and_cancel_a_queued_job(make_server):
    async with make_server(workers=0) as h:  # no worker: the job stays queued
        job = (await h.submit()).json()
        assert job["status"] == "queued"
        for path in ("report", "artifact"):
            body = assert_problem(await h.client.get(f"/v1/jobs/{job['id']}/{path}"), 409)
            assert "queued" in body["detail"]
        r = await h.client.delete(f"/v1/jobs/{job['id']}")
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        async with h.client.stream("GET", f"/v1/jobs/{job['id']}/events") as resp:
            text = (await resp.aread()).decode()
        assert text.rstrip().split("\n\n")[-1].startswith("event: cancelled")
        assert list((h.settings.data_dir / "uploads").iterdir()) == []


async def test_idempotency_key_returns_the_same_job(make_server):
    async with make_server(workers=0) as h:
        data = st_bytes(seed=3)
        r1 = await h.submit(data, headers={"Idempotency-Key": "k-1"})
        r2 = await h.submit(data, headers={"Idempotency-Key": "k-1"})
        assert r1.status_code == r2.status_code == 202
        assert r1.json()["id"] == r2.json()["id"]
        assert len((await h.client.get("/v1/jobs")).json()["items"]) == 1
        body = assert_problem(await h.submit(st_bytes(seed=4), headers={"Idempotency-Key": "k-1"}), 409)
        assert "idempotency" in body["detail"]
        # only the one upload is kept; the retries' temp files are gone
        assert len(list((h.settings.data_dir / "uploads").iterdir())) == 1
        assert list(h.settings.tmp_dir.glob("upload-*")) == []


async def test_list_pagination_and_status_filter(make_server):
    async with make_server(workers=0) as h:
        ids = [(await h.submit(st_bytes(seed=i))).json()["id"] for i in range(5)]
        await h.client.delete(f"/v1/jobs/{ids[0]}")
        seen: list[str] = []
        cursor = None
        for _ in range(10):
            params = {"limit": 2} | ({"cursor": cursor} if cursor else {})
            page = (await h.client.get("/v1/jobs", params=params)).json()
            assert len(page["items"]) <= 2
            seen += [j["id"] for j in page["items"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert seen == ids[::-1]  # newest first, each once
        queued = (await h.client.get("/v1/jobs", params={"status": "queued"})).json()["items"]
        assert [j["id"] for j in queued] == ids[:0:-1]
        bad = assert_problem(await h.client.get("/v1/jobs", params={"cursor": "garbage"}), 422)
        assert bad["errors"][0]["loc"] == ["query", "cursor"]
        nested = base64.urlsafe_b64encode(b"[" * 5000 + b"]" * 5000).decode()  # JSON nested past the recursion limit
        bad = assert_problem(await h.client.get("/v1/jobs", params={"cursor": nested}), 422)
        assert bad["errors"][0]["loc"] == ["query", "cursor"]
        bad = assert_problem(await h.client.get("/v1/jobs", params={"status": "done"}), 422)
        assert bad["errors"][0]["loc"] == ["query", "status"]


async def test_queue_full_is_429_with_retry_after(make_server):
    async with make_server(workers=0, max_queue=2) as h:
        assert (await h.submit(st_bytes(seed=1))).status_code == 202
        assert (await h.submit(st_bytes(seed=2))).status_code == 202
        r = await h.submit(st_bytes(seed=3))
        assert_problem(r, 429)
        assert int(r.headers["retry-after"]) >= 1
        assert list(h.settings.tmp_dir.glob("upload-*")) == []


async def test_a_submission_never_waits_for_synchronous_quantizations(make_server):
    """Every synchronous slot busy (long /v1/quantize calls): a job's submission checks still run at once."""
    async with make_server(workers=0) as h:
        limiter = h.app.state.quantd.sync_limiter
        holders = [object() for _ in range(int(limiter.total_tokens))]
        for holder in holders:
            await limiter.acquire_on_behalf_of(holder)
        try:
            with anyio.fail_after(60):
                assert (await h.submit(st_bytes(seed=4))).status_code == 202
        finally:
            for holder in holders:
                limiter.release_on_behalf_of(holder)


async def test_config_is_checked_against_the_tensors_before_accepting(server):
    cfg = {"scheme": {"dtype": "int4", "granularity": "group", "group_size": 48}}  # 64 % 48 != 0
    body = assert_problem(await server.submit(config=cfg), 422)
    assert "group_size" in body["detail"] and "layer.weight" in body["detail"]
    assert body["errors"][0]["loc"][-1] == "group_size"
    assert (await server.client.get("/v1/jobs")).json()["items"] == []


async def test_unknown_job_is_404(server):
    for path in ("", "/events", "/report", "/artifact"):
        assert_problem(await server.client.get(f"/v1/jobs/{'0' * 32}{path}"), 404)
    assert_problem(await server.client.delete("/v1/jobs/nope"), 404)


async def test_calibration_file_is_accepted_with_the_job(make_server):
    async with make_server(workers=0) as h:
        calib = st_bytes({"act": __import__("torch").randn(8, 16)})
        files = {"file": ("m.safetensors", st_bytes(), "application/octet-stream"),
                 "calibration": ("acts.safetensors", calib, "application/octet-stream")}
        r = await h.client.post("/v1/jobs", files=files, data={"config": json.dumps(CONFIG)})
        assert r.status_code == 202, r.text
        assert len(list((h.settings.data_dir / "uploads").iterdir())) == 2
        files["calibration"] = ("acts.safetensors", b"garbage! not a tensor file", "application/octet-stream")
        r = await h.client.post("/v1/jobs", files=files, data={"config": json.dumps(CONFIG)})
        body = assert_problem(r, 415)  # which of the two files it is
        assert body["detail"].startswith("the calibration file: unrecognised file content"), body


async def test_calibration_ranges_land_in_the_report_and_artifact(server):
    import torch

    acts = torch.linspace(-1.0, 3.0, 8 * 16).reshape(8, 16)
    files = {"file": ("m.safetensors", st_bytes(), "application/octet-stream"),
             "calibration": ("acts.safetensors", st_bytes({"layer.input": acts}), "application/octet-stream")}
    config = {**CONFIG, "activations": {"dtype": "uint8", "observer": "minmax"}}
    r = await server.client.post("/v1/jobs", files=files, data={"config": json.dumps(config)})
    assert r.status_code == 202, r.text
    job = await server.wait_job(r.json()["id"])
    assert job["status"] == "succeeded", job
    rep = (await server.client.get(f"/v1/jobs/{job['id']}/report")).json()
    (layer,) = rep["activations"]
    assert layer["name"] == "layer.input" and layer["min"] == -1.0 and layer["max"] == 3.0
    assert layer["num_samples"] == 8 and abs(layer["scale"] - 4.0 / 255) <= 2**-15
    art = read_artifact((await server.client.get(f"/v1/jobs/{job['id']}/artifact")).content)
    assert art.metadata["activations"] == rep["activations"]


@pytest.mark.cuda
async def test_job_and_sync_quantize_run_on_cuda(make_server):
    async with make_server(device="cuda") as h:
        info = (await h.client.get("/v1/info")).json()
        assert any(d["type"] == "cuda" and d["memory_bytes"] > 0 for d in info["devices"])
        job = await h.wait_job((await h.submit()).json()["id"])
        assert job["status"] == "succeeded" and job["device"].startswith("cuda")
        r = await h.client.post("/v1/quantize", files={"file": ("m.safetensors", st_bytes(), "x/y")},
                                data={"config": json.dumps(CONFIG)})
        assert r.status_code == 200 and json.loads(r.headers["quantd-summary"])["device"].startswith("cuda")


async def test_large_upload_is_written_back_while_it_streams(server, monkeypatch: pytest.MonkeyPatch):
    import torch
    from safetensors.torch import save

    from quantd.server import uploads

    kicks: list[tuple[int, int]] = []
    real = uploads.start_writeback

    def spy(fd: int, offset: int, nbytes: int) -> None:
        kicks.append((offset, nbytes))
        real(fd, offset, nbytes)

    monkeypatch.setattr(uploads, "WRITEBACK_BYTES", 64 * 1024)
    monkeypatch.setattr(uploads, "start_writeback", spy)
    data = save({"w": torch.randn(256, 1024)})  # 1 MiB
    r = await server.submit(data)
    assert r.status_code == 202, r.text
    assert kicks and sum(n for _, n in kicks) <= len(data)  # one kick per ≥ 64 KiB written (per body batch)
    assert [o for o, _ in kicks] == sorted(o for o, _ in kicks) and kicks[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(kicks))  # consecutive ranges, no gap
