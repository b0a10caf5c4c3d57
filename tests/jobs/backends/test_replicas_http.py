"""Two API replicas (ASGI apps) on one PostgreSQL and one bucket: a job submitted to one is run by the
other's worker, followed, read and downloaded (Range, ETag, presigned redirect) from either, and deleted
with its objects."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save

from quantd.jobs.backends.s3 import S3Storage

CONFIG = {"scheme": {"dtype": "int8", "granularity": "channel", "symmetric": True}}


def model_bytes(seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return save({"layer.weight": torch.randn(32, 64, generator=g), "layer.bias": torch.randn(32, generator=g)})


def keys(s3: Any, bucket: str) -> list[str]:
    return sorted(S3Storage(f"s3://{bucket}/quantd", Path("/nonexistent"), client=s3.client()).list_keys())


async def test_submit_on_one_replica_follow_and_download_on_the_other(replicas: Any, s3: Any, bucket: str,
                                                                        tmp_path: Path) -> None:
    data = model_bytes()
    async with replicas({"workers": 0}, {"workers": 1}, {"workers": 0, "storage_presign": True}) as (a, b, c):
        r = await a.post("/v1/jobs", files={"file": ("m.safetensors", data)}, data={"config": json.dumps(CONFIG)})
        assert r.status_code == 202, r.text
        job = r.json()
        # stored before the 202 (b's worker may already have added the artifact and the report)
        assert f"quantd/uploads/{job['id']}.input" in keys(s3, bucket)

        async with a.stream("GET", f"/v1/jobs/{job['id']}/events") as resp:  # run by b's worker
            text = (await resp.aread()).decode()
        names = [blk.split("\n")[0].removeprefix("event: ") for blk in text.split("\n\n") if blk.startswith("event:")]
        assert names[-1] == "succeeded", text

        done = (await c.get(f"/v1/jobs/{job['id']}")).json()
        assert done["status"] == "succeeded" and done["attempts"] == 1
        r = await a.get(f"/v1/jobs/{job['id']}/artifact")
        art = r.content
        sha = hashlib.sha256(art).hexdigest()
        assert r.status_code == 200 and sha == done["result"]["artifact_sha256"] and r.headers["etag"] == f'"{sha}"'
        r = await b.get(f"/v1/jobs/{job['id']}/artifact", headers={"Range": "bytes=100-199"})
        assert r.status_code == 206 and r.content == art[100:200]
        assert r.headers["content-range"] == f"bytes 100-199/{len(art)}"
        r = await a.get(f"/v1/jobs/{job['id']}/artifact", headers={"If-None-Match": f'"{sha}"'})
        assert r.status_code == 304
        r = await a.head(f"/v1/jobs/{job['id']}/artifact")
        assert r.status_code == 200 and int(r.headers["content-length"]) == len(art) and r.content == b""
        r = await c.get(f"/v1/jobs/{job['id']}/artifact")
        assert r.status_code == 307 and r.headers["etag"] == f'"{sha}"'
        async with httpx.AsyncClient() as direct:  # the presigned URL, straight from the object store
            assert (await direct.get(r.headers["location"])).content == art
        # the SDK follows the 307 to the real object store (moto), resuming there, sha256-checked
        from quantd_client import AsyncClient

        mounts = {"http://replica2": c._transport}  # the API in process; the presigned URL over the network
        async with httpx.AsyncClient(mounts=mounts) as http, AsyncClient("http://replica2", http_client=http) as sdk:
            handle = await sdk.get_job(job["id"])
            dst = tmp_path / "sdk" / "a.safetensors"
            dst.parent.mkdir()
            (tmp_path / "sdk" / "a.safetensors.part").write_bytes(art[:100])  # resumed with Range at the store
            assert await handle.download(dst, progress=False) == dst and dst.read_bytes() == art
        rep = (await c.get(f"/v1/jobs/{job['id']}/report")).json()
        assert rep["job_id"] == job["id"]
        assert keys(s3, bucket) == sorted([f"quantd/uploads/{job['id']}.input",
                                           f"quantd/artifacts/{job['id']}.safetensors",
                                           f"quantd/reports/{job['id']}.json"])

        assert (await b.delete(f"/v1/jobs/{job['id']}")).status_code == 200
        assert keys(s3, bucket) == []
        r = await a.get(f"/v1/jobs/{job['id']}/artifact")
        assert r.status_code == 410
        ready = (await a.get("/readyz")).json()
        assert r.status_code == 410 and ready["status"] == "ready", ready


async def test_tenants_and_idempotency_hold_across_replicas(replicas: Any) -> None:
    keys_spec = "a:key-tenant-a-0001,b:key-tenant-b-0002"
    ha, hb = {"Authorization": "Bearer key-tenant-a-0001"}, {"Authorization": "Bearer key-tenant-b-0002"}
    async with replicas({"workers": 0, "api_keys": keys_spec}, {"workers": 0, "api_keys": keys_spec}) as (a, b):
        data = model_bytes(1)
        first = await a.post("/v1/jobs", files={"file": ("m.safetensors", data)}, data={"config": json.dumps(CONFIG)},
                             headers={**ha, "Idempotency-Key": "k"})
        again = await b.post("/v1/jobs", files={"file": ("m.safetensors", data)}, data={"config": json.dumps(CONFIG)},
                             headers={**ha, "Idempotency-Key": "k"})
        assert first.status_code == again.status_code == 202 and first.json()["id"] == again.json()["id"]
        job_id = first.json()["id"]
        assert (await b.get(f"/v1/jobs/{job_id}", headers=hb)).status_code == 404
        assert (await b.get(f"/v1/jobs/{job_id}", headers=ha)).status_code == 200
        assert [j["id"] for j in (await b.get("/v1/jobs", headers=ha)).json()["items"]] == [job_id]
        assert (await a.get("/v1/jobs", headers=hb)).json()["items"] == []
