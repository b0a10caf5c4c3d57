"""Model directories on PostgreSQL + S3: directory jobs uploaded to one replica, run by another's worker, served
file by file (Range, ETag) and as a tar from a third, and deleted with every object; and jobs by reference whose
``source`` is a directory prefix, listed, checked before the 202 and written file by file under ``destination``."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load, save

from quantd.jobs.backends.s3 import S3Storage

CONFIG = {"scheme": {"dtype": "int8", "granularity": "channel", "symmetric": True}}
CT_CONFIG = {"output": "compressed-tensors", **CONFIG}
HA = {"Authorization": "Bearer key-tenant-a-0001"}
BERT = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 100, "max_position_embeddings": 32}


def model_dir(seed: int = 0) -> dict[str, bytes]:
    """A two-shard model directory: weights split across shards, an index, config.json and another file."""
    g = torch.Generator().manual_seed(seed)
    a = {"encoder.layer.0.attention.self.query.weight": torch.randn(64, 64, generator=g),
         "encoder.layer.0.attention.self.query.bias": torch.randn(64, generator=g)}
    b = {"encoder.layer.0.intermediate.dense.weight": torch.randn(128, 64, generator=g)}
    index = {"metadata": {"total_size": 0}, "weight_map": {
        **dict.fromkeys(a, "model-00001-of-00002.safetensors"), **dict.fromkeys(b, "model-00002-of-00002.safetensors")}}
    return {"config.json": json.dumps(BERT).encode(), "model-00001-of-00002.safetensors": save(a),
            "model-00002-of-00002.safetensors": save(b), "model.safetensors.index.json": json.dumps(index).encode(),
            "extra/notes.txt": b"kept byte for byte\n"}


@pytest.fixture
def replicas(replicas: Callable[..., Any], bucket: str) -> Callable[..., Any]:
    """The shared replicas, keyed for tenant ``a`` with its source prefix, every request as that tenant."""
    return functools.partial(replicas, headers=HA, defaults={
        "api_keys": "a:key-tenant-a-0001", "source_prefixes": f"a=s3://{bucket}/team-a/"})


def job_keys(s3: Any, bucket: str) -> list[str]:
    return sorted(S3Storage(f"s3://{bucket}/quantd", Path("/nonexistent"), client=s3.client()).list_keys())


async def wait_job(client: httpx.AsyncClient, job_id: str) -> dict[str, Any]:
    async with client.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
        await resp.aread()
    return dict((await client.get(f"/v1/jobs/{job_id}")).json())


async def check_served(client: httpx.AsyncClient, job: dict[str, Any]) -> dict[str, bytes]:
    """Every listed file served whole, by range and by ETag, and the same bytes inside the artifact's tar."""
    listed = (await client.get(f"/v1/jobs/{job['id']}/files")).json()["files"]
    served: dict[str, bytes] = {}
    for entry in listed:
        url = f"/v1/jobs/{job['id']}/files/{entry['path']}"
        r = await client.get(url)
        assert r.status_code == 200 and hashlib.sha256(r.content).hexdigest() == entry["sha256"]
        assert r.headers["etag"] == f'"{entry["sha256"]}"' and len(r.content) == entry["bytes"]
        served[entry["path"]] = r.content
        if entry["bytes"] > 20:
            part = await client.get(url, headers={"Range": "bytes=10-19"})
            assert part.status_code == 206 and part.content == r.content[10:20]
            assert part.headers["content-range"] == f"bytes 10-19/{entry['bytes']}"
        assert (await client.get(url, headers={"If-None-Match": f'"{entry["sha256"]}"'})).status_code == 304
    r = await client.get(f"/v1/jobs/{job['id']}/artifact")
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        in_tar = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]
    assert in_tar == served
    return served


@pytest.mark.parametrize("kind", ["directory", "one-file compressed-tensors"])
async def test_directory_jobs_across_replicas_and_deleted_from_the_bucket(replicas: Any, s3: Any, bucket: str,
                                                                           kind: str) -> None:
    if kind == "directory":
        parts = [("file", (path, data, "application/octet-stream")) for path, data in model_dir().items()]
        config, expected = CONFIG, set(model_dir())
    else:
        data = model_dir()["model-00001-of-00002.safetensors"]
        parts = [("file", ("m.safetensors", data, "application/octet-stream"))]
        config, expected = CT_CONFIG, {"config.json", "model.safetensors"}
    async with replicas({"workers": 0}, {"workers": 1}, {"workers": 0}) as (a, b, c):
        r = await a.post("/v1/jobs", files=parts, data={"config": json.dumps(config)})
        assert r.status_code == 202, r.text
        job = await wait_job(a, r.json()["id"])
        assert job["status"] == "succeeded", job["error"]
        served = await check_served(c, job)
        assert set(served) == expected
        if kind == "directory":
            assert served["extra/notes.txt"] == b"kept byte for byte\n"
        shard = load(served["model.safetensors" if kind != "directory" else "model-00002-of-00002.safetensors"])
        assert any(t.dtype == torch.int8 for t in shard.values())
        assert job_keys(s3, bucket) != []
        assert (await b.delete(f"/v1/jobs/{job['id']}")).status_code == 200
        assert job_keys(s3, bucket) == []
        assert (await c.get(f"/v1/jobs/{job['id']}/files/config.json")).status_code == 410


async def test_a_directory_job_with_a_calibration_part_on_the_bucket(replicas: Any) -> None:
    """The calibration part streams to the bucket beside the directory's parts: packing the directory into its
    tar discards the parts' objects, not the calibration's, which the job then adopts."""
    g = torch.Generator().manual_seed(1)
    calibration = save({"encoder.layer.0.attention.self.query": torch.randn(96, 64, generator=g),
                        "encoder.layer.0.intermediate.dense": torch.randn(96, 64, generator=g)})
    parts = [("file", (path, data, "application/octet-stream")) for path, data in model_dir().items()]
    parts.append(("calibration", ("calibration.safetensors", calibration, "application/octet-stream")))
    config = {"scheme": {"dtype": "int4", "group_size": 32, "method": "gptq"}}
    async with replicas({"workers": 0}, {"workers": 1}) as (a, b):
        r = await a.post("/v1/jobs", files=parts, data={"config": json.dumps(config)})
        assert r.status_code == 202, r.text
        job = await wait_job(b, r.json()["id"])
        assert job["status"] == "succeeded", job["error"]
        report = (await a.get(f"/v1/jobs/{job['id']}/report")).json()
        errors = {t["name"]: t["stats"]["output_rel_error"] for t in report["tensors"] if not t["skipped"]}
        assert len(errors) == 2 and all(0.0 < e < 0.1 for e in errors.values()), errors


def put_dir(s3: Any, bucket: str, prefix: str, files: dict[str, bytes]) -> None:
    client = s3.client()
    for rel, data in files.items():
        client.put_object(Bucket=bucket, Key=prefix + rel, Body=data)


def objects(s3: Any, bucket: str, prefix: str) -> dict[str, bytes]:
    client = s3.client()
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix):]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}


async def test_a_directory_source_is_listed_checked_quantized_and_written_file_by_file(
        replicas: Any, s3: Any, bucket: str) -> None:
    put_dir(s3, bucket, "team-a/bert/", model_dir())
    for marker in ("team-a/bert/", "team-a/bert/sub/"):  # a console's folder markers, the prefix's own too
        s3.client().put_object(Bucket=bucket, Key=marker, Body=b"")
    body = {"config": CONFIG, "source": f"s3://{bucket}/team-a/bert/", "destination": f"s3://{bucket}/team-a/out/"}
    async with replicas({"workers": 0}, {"workers": 1}) as (a, b):
        r = await a.post("/v1/jobs", json=body)
        assert r.status_code == 202, r.text
        accepted = r.json()
        assert accepted["source"] == body["source"] and accepted["input"]["filename"] == "bert"
        assert {f["path"] for f in accepted["input"]["files"]} == set(model_dir())
        assert accepted["input"]["bytes"] == sum(map(len, model_dir().values()))
        assert accepted["input"]["tensors"] == 3 and accepted["input"]["format"] == "safetensors"
        job = await wait_job(b, accepted["id"])
        assert job["status"] == "succeeded", job["error"]
        digests = {rel: hashlib.sha256(data).hexdigest() for rel, data in model_dir().items()}
        assert {f["path"]: f["sha256"] for f in job["input"]["files"]} == digests  # read by the worker
        lines = "".join(f"{rel}\0{digests[rel]}\n" for rel in sorted(digests))  # as an uploaded directory's
        assert job["input"]["sha256"] == hashlib.sha256(lines.encode()).hexdigest()
        served = await check_served(a, job)
        assert set(served) == set(model_dir())
        assert objects(s3, bucket, "team-a/out/") == served  # every output file under the destination
        assert served["extra/notes.txt"] == b"kept byte for byte\n"
        assert any(t.dtype == torch.int8 for t in load(served["model-00002-of-00002.safetensors"]).values())
        assert (await a.delete(f"/v1/jobs/{job['id']}")).status_code == 200
        assert job_keys(s3, bucket) == []  # the job's own objects go; source and destination stay
        assert set(objects(s3, bucket, "team-a/bert/")) == {*model_dir(), "", "sub/"}
        assert objects(s3, bucket, "team-a/out/") == served


async def test_a_one_file_source_writing_a_directory_fills_the_destination_prefix(
        replicas: Any, s3: Any, bucket: str) -> None:
    s3.client().put_object(Bucket=bucket, Key="team-a/m.safetensors",
                           Body=model_dir()["model-00001-of-00002.safetensors"])
    body = {"config": CT_CONFIG, "source": f"s3://{bucket}/team-a/m.safetensors"}
    async with replicas({"workers": 1}) as (a,):
        r = await a.post("/v1/jobs", json={**body, "destination": f"s3://{bucket}/team-a/ct.safetensors"})
        assert r.status_code == 422 and r.json()["type"] == "urn:quantd:destination-invalid", r.text
        r = await a.post("/v1/jobs", json={**body, "destination": f"s3://{bucket}/team-a/ct/"})
        assert r.status_code == 202, r.text
        job = await wait_job(a, r.json()["id"])
        assert job["status"] == "succeeded", job["error"]
        assert set(objects(s3, bucket, "team-a/ct/")) == {"config.json", "model.safetensors"}
        assert objects(s3, bucket, "team-a/ct/") == await check_served(a, job)


def _index_naming_a_missing_shard(files: dict[str, bytes]) -> dict[str, bytes]:
    index = json.loads(files["model.safetensors.index.json"])
    index["weight_map"]["extra.weight"] = "model-00003-of-00003.safetensors"
    return {**files, "model.safetensors.index.json": json.dumps(index).encode()}


@pytest.mark.parametrize(("case", "status", "needle"), [
    ("dot-dot", 422, "'..'"), ("missing-shard", 422, "model-00003-of-00003.safetensors"),
    ("bin-shard", 422, "not safetensors"), ("too-large", 413, "bytes"), ("empty", 422, "no objects"),
    ("destination-not-prefix", 422, "prefix ending in '/'"), ("outside", 403, "allowed prefix")])
async def test_a_bad_directory_source_is_refused_before_the_job_exists(replicas: Any, s3: Any, bucket: str,
                                                                       case: str, status: int, needle: str) -> None:
    files = model_dir()
    if case == "dot-dot":
        files = {**files, "sub/../config.json": b"{}"}
    elif case == "missing-shard":
        files = _index_naming_a_missing_shard(files)
    elif case == "bin-shard":
        files = {**files, "pytorch_model.bin": b"PK\x03\x04"}
    if case != "empty":
        put_dir(s3, bucket, "team-a/src/", files)
    source = f"s3://{bucket}/{'other/' if case == 'outside' else 'team-a/'}src/"
    destination = f"s3://{bucket}/team-a/{'out' if case == 'destination-not-prefix' else 'out/'}"
    limit = {"max_upload_bytes": 1000, "max_sync_bytes": 1000} if case == "too-large" else {}
    async with replicas({"workers": 0, **limit}) as (a,):
        r = await a.post("/v1/jobs", json={"config": CONFIG, "source": source, "destination": destination})
        assert r.status_code == status and needle in r.json()["detail"], r.text
        assert r.headers["content-type"] == "application/problem+json"
        assert (await a.get("/v1/jobs")).json()["items"] == []
    assert job_keys(s3, bucket) == []


async def test_a_directory_source_changed_after_acceptance_fails_the_job(replicas: Any, s3: Any, bucket: str) -> None:
    put_dir(s3, bucket, "team-a/bert/", model_dir())
    async with replicas({"workers": 0}) as (a,):  # accepted, not yet run
        r = await a.post("/v1/jobs", json={"config": CONFIG, "source": f"s3://{bucket}/team-a/bert/"})
        assert r.status_code == 202, r.text
    put_dir(s3, bucket, "team-a/bert/", {"model-00002-of-00002.safetensors": model_dir(seed=1)[
        "model-00002-of-00002.safetensors"]})
    async with replicas({"workers": 1}) as (b,):
        job = await wait_job(b, r.json()["id"])
        assert job["status"] == "failed" and job["error"]["type"] == "urn:quantd:source-invalid", job
        assert "changed or deleted" in job["error"]["detail"]
