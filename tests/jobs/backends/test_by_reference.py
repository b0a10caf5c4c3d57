"""Jobs by reference (``POST /v1/jobs`` as JSON): the server reads an ``s3://`` source under the tenant's
allowed prefixes and writes the artifact to the destination too; anything else is 403 and never fetched."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save

from quantd.jobs.references import References
from quantd.server.app import create_app
from quantd.server.settings import Settings

CONFIG = {"scheme": {"dtype": "int4", "group_size": 32}}
HA, HB = {"Authorization": "Bearer key-tenant-a-0001"}, {"Authorization": "Bearer key-tenant-b-0002"}


def model_bytes() -> bytes:
    g = torch.Generator().manual_seed(3)
    return save({"layer.weight": torch.randn(16, 64, generator=g), "layer.bias": torch.randn(16, generator=g)})


@pytest.fixture
def make_app(s3: Any, bucket: str, tmp_path: Path) -> Callable[..., Any]:
    @asynccontextmanager
    async def start(**overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
        values: dict[str, Any] = {
            "data_dir": tmp_path / "data", "device": "cpu", "workers": 1, "log_level": "WARNING", "warmup": False,
            "s3_endpoint_url": s3.endpoint, "api_keys": "a:key-tenant-a-0001,b:key-tenant-b-0002",
            "source_prefixes": f"a=s3://{bucket}/team-a/,*=s3://{bucket}/shared/"}
        values.update(overrides)
        app = create_app(Settings(**values))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                yield client

    return start


async def wait_job(client: httpx.AsyncClient, job_id: str, headers: dict[str, str]) -> dict[str, Any]:
    async with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as resp:
        await resp.aread()
    return dict((await client.get(f"/v1/jobs/{job_id}", headers=headers)).json())


@pytest.mark.parametrize("storage", ["file", "s3"])
async def test_source_read_and_destination_written(make_app: Any, s3: Any, bucket: str, storage: str) -> None:
    client = s3.client()
    data = model_bytes()
    client.put_object(Bucket=bucket, Key="team-a/llm/model.safetensors", Body=data)
    extra = {"storage_url": f"s3://{bucket}/jobs"} if storage == "s3" else {}
    async with make_app(**extra) as app:
        body = {"config": CONFIG, "source": f"s3://{bucket}/team-a/llm/model.safetensors",
                "destination": f"s3://{bucket}/team-a/out/"}
        r = await app.post("/v1/jobs", json=body, headers=HA)
        assert r.status_code == 202, r.text
        job = r.json()
        assert job["source"] == body["source"] and job["destination"] == body["destination"]
        assert job["input"]["bytes"] == len(data) and job["input"]["format"] == "safetensors"
        assert job["input"]["tensors"] == 2 and job["input"]["filename"] == "model.safetensors"
        assert job["input"]["sha256"] == ""  # the object is read by the worker, not before the 202
        done = await wait_job(app, job["id"], HA)
        assert done["status"] == "succeeded", done["error"]
        assert done["input"]["sha256"] == hashlib.sha256(data).hexdigest()  # once the worker has read it
        art = (await app.get(f"/v1/jobs/{job['id']}/artifact", headers=HA)).content
        assert hashlib.sha256(art).hexdigest() == done["result"]["artifact_sha256"]
        written = client.get_object(Bucket=bucket, Key="team-a/out/model.quantd.safetensors")["Body"].read()
        assert written == art
        assert (await app.delete(f"/v1/jobs/{job['id']}", headers=HA)).status_code == 200
        # The job's own copies go; the tenant's source and destination objects are never deleted.
        assert client.head_object(Bucket=bucket, Key="team-a/llm/model.safetensors")["ContentLength"] == len(data)
        assert client.head_object(Bucket=bucket, Key="team-a/out/model.quantd.safetensors")


async def test_a_gguf_output_under_a_destination_prefix_ends_in_gguf(make_app: Any, s3: Any, bucket: str,
                                                                     tmp_path: Path) -> None:
    from _gguf_models import write_tiny_llama

    client = s3.client()
    client.put_object(Bucket=bucket, Key="team-a/llm/model.gguf",
                      Body=write_tiny_llama(tmp_path / "model.gguf").read_bytes())
    async with make_app() as app:
        body = {"config": {"output": "gguf", "gguf_mix": "Q8_0"}, "source": f"s3://{bucket}/team-a/llm/model.gguf",
                "destination": f"s3://{bucket}/team-a/out/"}
        r = await app.post("/v1/jobs", json=body, headers=HA)
        assert r.status_code == 202, r.text
        done = await wait_job(app, r.json()["id"], HA)
        assert done["status"] == "succeeded", done["error"]
        written = client.get_object(Bucket=bucket, Key="team-a/out/model.gguf")["Body"].read()
        assert written[:4] == b"GGUF"
        assert written == (await app.get(f"/v1/jobs/{r.json()['id']}/artifact", headers=HA)).content


@pytest.mark.parametrize(("headers", "source", "destination"), [
    (HB, "s3://{b}/team-a/llm/model.safetensors", None),              # another tenant's prefix
    (HA, "s3://{b}/team-b/model.safetensors", None),                  # outside every prefix
    (HA, "s3://{b}/team-a/../team-b/model.safetensors", None),        # dot segments
    (HA, "s3://{b}/team-a", None),                                    # the prefix without its slash
    (HA, "s3://other-bucket/team-a/model.safetensors", None),         # same path, other bucket
    (HA, "http://169.254.169.254/latest/meta-data/", None),           # no other scheme, ever
    (HA, "file:///etc/passwd", None),
    (HA, "S3://{b}/team-a/llm/model.safetensors", None),
    (HA, "s3://{b}/team-a/llm/model.safetensors", "s3://{b}/elsewhere/"),  # destination checked too
    (HA, "s3://{b}/team-a/llm/model.safetensors", "https://example.com/x"),
])
async def test_anything_outside_the_allowed_prefixes_is_403_and_never_fetched(
        make_app: Any, bucket: str, monkeypatch: pytest.MonkeyPatch, headers: dict[str, str], source: str,
        destination: str | None) -> None:
    def no_fetch(self: References) -> None:
        raise AssertionError("a forbidden source was fetched")

    monkeypatch.setattr(References, "client", property(no_fetch))
    async with make_app() as app:
        body = {"config": CONFIG, "source": source.format(b=bucket),
                "destination": destination.format(b=bucket) if destination else None}
        r = await app.post("/v1/jobs", json=body, headers=headers)
        assert r.status_code == 403, r.text
        problem = r.json()
        assert r.headers["content-type"].startswith("application/problem+json")
        assert problem["type"] == "urn:quantd:source-forbidden" and "Traceback" not in r.text
        assert (await app.get("/v1/jobs", headers=headers)).json()["items"] == []


async def test_shared_prefix_and_open_mode(make_app: Any, s3: Any, bucket: str) -> None:
    s3.client().put_object(Bucket=bucket, Key="shared/m.safetensors", Body=model_bytes())
    async with make_app(api_keys=None, source_prefixes=f"*=s3://{bucket}/shared/") as app:
        r = await app.post("/v1/jobs", json={"config": CONFIG, "source": f"s3://{bucket}/shared/m.safetensors"})
        assert r.status_code == 202, r.text
        assert (await wait_job(app, r.json()["id"], {}))["status"] == "succeeded"
    async with make_app(api_keys=None, source_prefixes=None) as app:  # nothing configured: nothing allowed
        r = await app.post("/v1/jobs", json={"config": CONFIG, "source": f"s3://{bucket}/shared/m.safetensors"})
        assert r.status_code == 403 and "no prefix is allowed" in r.json()["detail"]


async def test_bad_sources_are_refused_before_the_job_is_accepted(make_app: Any, s3: Any, bucket: str) -> None:
    client = s3.client()
    client.put_object(Bucket=bucket, Key="team-a/m.safetensors", Body=model_bytes())
    client.put_object(Bucket=bucket, Key="team-a/notes.txt", Body=b"hello, not a model")
    client.put_object(Bucket=bucket, Key="team-a/big.safetensors", Body=b"\0" * 9000)
    async with make_app(max_upload_bytes=8000, max_sync_bytes=4096) as app:
        async def post(body: dict[str, Any]) -> httpx.Response:
            return await app.post("/v1/jobs", json=body, headers=HA)

        src = f"s3://{bucket}/team-a/m.safetensors"
        r = await post({"config": CONFIG, "source": f"s3://{bucket}/team-a/missing.safetensors"})
        assert r.status_code == 422 and "cannot be read" in r.json()["detail"]
        r = await post({"config": CONFIG, "source": f"s3://{bucket}/team-a/"})
        assert r.status_code == 413  # a model directory: its objects together are above max_upload_bytes
        assert (await post({"config": CONFIG, "source": f"s3://{bucket}/team-a/none/"})).status_code == 422
        assert (await post({"config": CONFIG, "source": f"s3://{bucket}/team-a/notes.txt"})).status_code == 415
        r = await post({"config": {"scheme": {"dtype": "int4", "group_size": 48}}, "source": src})
        assert r.status_code == 422 and "group_size" in r.text  # planned against the header, as an upload
        r = await post({"config": {"output": "gguf", "gguf_mix": "Q8_0"}, "source": src})
        assert r.status_code == 422 and "needs a GGUF input" in r.json()["detail"]  # as an upload's
        pt = io.BytesIO()
        torch.save({"w": torch.randn(8, 8)}, pt)
        client.put_object(Bucket=bucket, Key="team-a/m.pt", Body=pt.getvalue())
        r = await post({"config": {"output": "gguf", "gguf_mix": "Q8_0"}, "source": f"s3://{bucket}/team-a/m.pt"})
        assert r.status_code == 422 and "a pytorch file" in r.json()["detail"]  # a format not opened at submit
        assert (await post({"config": CONFIG, "source": src, "extra": 1})).status_code == 422
        r = await app.post("/v1/jobs", content=b"{not json", headers={**HA, "Content-Type": "application/json"})
        assert r.status_code == 422
        r = await post({"config": CONFIG, "source": f"s3://{bucket}/team-a/big.safetensors"})
        assert r.status_code == 413  # larger than max_upload_bytes: refused on its size alone
        assert (await app.get("/v1/jobs", headers=HA)).json()["items"] == []


@pytest.mark.parametrize(("source", "destination", "output"), [
    ("team-a/m.safetensors", "team-a/m.safetensors", "safetensors"),  # the same object
    ("team-a/m.gguf", "team-a/", "gguf"),  # a prefix whose output key is the source's (m.gguf)
    ("team-a/ct/model.safetensors", "team-a/ct/", "compressed-tensors"),  # the directory output's shard
    ("team-a/dir/", "team-a/dir/", "safetensors"),  # a directory written over itself
])
async def test_a_destination_over_its_source_is_refused(make_app: Any, s3: Any, bucket: str, tmp_path: Path,
                                                        source: str, destination: str, output: str) -> None:
    """A job by reference never writes over its input: a destination where the output writes one of the
    source's keys is a 422 naming the destination, and the tenant's objects stay as they are. Outputs beside
    the source, above it or inside a source directory write other keys and are fine."""
    from _gguf_models import write_tiny_llama

    client = s3.client()
    for key in ("team-a/m.safetensors", "team-a/ct/model.safetensors", "team-a/dir/model.safetensors"):
        client.put_object(Bucket=bucket, Key=key, Body=model_bytes())
    client.put_object(Bucket=bucket, Key="team-a/m.gguf", Body=write_tiny_llama(tmp_path / "m.gguf").read_bytes())
    config = {"output": "gguf", "gguf_mix": "Q8_0"} if output == "gguf" else {**CONFIG, "output": output}
    async with make_app() as app:
        r = await app.post("/v1/jobs", headers=HA, json={"config": config, "source": f"s3://{bucket}/{source}",
                                                         "destination": f"s3://{bucket}/{destination}"})
        assert r.status_code == 422, r.text
        assert "would write over the source" in r.json()["detail"]
        assert r.json()["errors"][0]["loc"][-1] == "destination"
        assert (await app.get("/v1/jobs", headers=HA)).json()["items"] == []
        for src, dst in (("m.safetensors", ""), ("dir/", "dir/out/"), ("dir/", "")):  # beside, inside, above
            body = {"config": CONFIG, "source": f"s3://{bucket}/team-a/{src}",
                    "destination": f"s3://{bucket}/team-a/{dst}"}
            assert (await app.post("/v1/jobs", headers=HA, json=body)).status_code == 202, (src, dst)
    for key in ("team-a/m.safetensors", "team-a/ct/model.safetensors", "team-a/dir/model.safetensors"):
        assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == model_bytes()


async def test_a_directory_source_with_a_path_that_is_also_a_folder_is_422(make_app: Any, s3: Any,
                                                                           bucket: str) -> None:
    """As for an uploaded directory: ``a`` beside ``a/b.json`` cannot both be written, named before the 202."""
    client = s3.client()
    for key, body in (("team-a/d/model.safetensors", model_bytes()), ("team-a/d/a", b"x"), ("team-a/d/a/b.json", b"{}")):
        client.put_object(Bucket=bucket, Key=key, Body=body)
    async with make_app() as app:
        r = await app.post("/v1/jobs", headers=HA, json={"config": CONFIG, "source": f"s3://{bucket}/team-a/d/"})
        assert r.status_code == 422, r.text
        assert "'a'" in r.json()["detail"] and "folder" in r.json()["detail"]


async def test_a_source_changed_after_acceptance_fails_the_job(make_app: Any, s3: Any, bucket: str) -> None:
    client = s3.client()
    client.put_object(Bucket=bucket, Key="team-a/m.safetensors", Body=model_bytes())
    async with make_app(workers=0) as app:  # accepted, not yet run
        r = await app.post("/v1/jobs", json={"config": CONFIG, "source": f"s3://{bucket}/team-a/m.safetensors"},
                           headers=HA)
        assert r.status_code == 202
        job_id = r.json()["id"]
    client.put_object(Bucket=bucket, Key="team-a/m.safetensors", Body=model_bytes() + b" ")
    async with make_app() as app:
        done = await wait_job(app, job_id, HA)
        assert done["status"] == "failed" and done["error"]["type"] == "urn:quantd:source-invalid"
        assert json.dumps(done).count("changed or deleted") == 1


async def test_openapi_describes_the_json_body_and_the_403(make_app: Any) -> None:
    async with make_app() as app:
        spec = (await app.get("/openapi.json")).json()
    post = spec["paths"]["/v1/jobs"]["post"]
    content = post["requestBody"]["content"]
    assert set(content) == {"multipart/form-data", "application/json"}
    assert content["application/json"]["schema"] == {"$ref": "#/components/schemas/JobByReference"}
    schema = spec["components"]["schemas"]["JobByReference"]
    assert schema["required"] == ["config", "source"] and schema["additionalProperties"] is False
    assert "403" in post["responses"]
    job = spec["components"]["schemas"]["Job"]["properties"]
    assert {"source", "destination"} <= set(job)
