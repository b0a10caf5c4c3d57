"""Server test harness: the ASGI app with its lifespan, over a fresh data dir, and small model files."""

from __future__ import annotations

import io
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from fastapi import FastAPI
from safetensors.torch import save

from quantd.server.app import create_app
from quantd.server.settings import Settings

KEY_A = "key-tenant-a-0001"
KEY_B = "key-tenant-b-0002"


def st_bytes(tensors: dict[str, torch.Tensor] | None = None, seed: int = 0) -> bytes:
    if tensors is None:
        g = torch.Generator().manual_seed(seed)
        tensors = {"layer.weight": torch.randn(16, 64, generator=g), "layer.bias": torch.randn(16, generator=g)}
    return save(tensors)


def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def pt_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


CONFIG = {"scheme": {"dtype": "int8", "granularity": "channel", "symmetric": True}}


def assert_problem(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/problem+json"), r.headers["content-type"]
    body = r.json()
    assert body["status"] == status
    assert isinstance(body["title"], str) and body["title"]
    assert isinstance(body["detail"], str) and body["detail"]
    assert "type" in body
    assert "Traceback" not in r.text
    return body


class Harness:
    def __init__(self, app: FastAPI, client: httpx.AsyncClient, settings: Settings) -> None:
        self.app, self.client, self.settings = app, client, settings

    async def submit(self, data: bytes = b"", *, config: dict[str, Any] | None = None, filename: str = "m.safetensors",
                     headers: dict[str, str] | None = None) -> httpx.Response:
        files = {"file": (filename, data or st_bytes(), "application/octet-stream")}
        return await self.client.post("/v1/jobs", files=files, data={"config": json.dumps(config or CONFIG)},
                                      headers=headers)

    async def wait_job(self, job_id: str, *, headers: dict[str, str] | None = None, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = await self.client.get(f"/v1/jobs/{job_id}", headers=headers)
            assert r.status_code == 200, r.text
            job = r.json()
            if job["status"] in ("succeeded", "failed", "cancelled"):
                return job
            await _tick()
        raise AssertionError(f"job {job_id} did not finish in {timeout} s")


async def _tick() -> None:
    import anyio

    await anyio.sleep(0.05)  # a poll step under a deadline, not a wait for work


MakeServer = Callable[..., Any]


@pytest.fixture
def make_server(tmp_path: Path) -> MakeServer:
    @asynccontextmanager
    async def factory(**overrides: Any) -> AsyncIterator[Harness]:
        values: dict[str, Any] = {"data_dir": tmp_path / "data", "device": "cpu", "workers": 1,
                                  "log_level": "WARNING", "warmup": False}
        values.update(overrides)
        settings = Settings(**values)
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                yield Harness(app, client, settings)

    return factory


@pytest.fixture
async def server(make_server: MakeServer) -> AsyncIterator[Harness]:
    async with make_server() as h:
        yield h


