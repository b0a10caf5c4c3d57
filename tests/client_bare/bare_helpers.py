"""Shared helpers of the bare-install SDK tests (no torch, no fastapi, no pytest-asyncio)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import httpx

from quantd_client._async import AsyncClient
from quantd_client._client import Client

T = TypeVar("T")
BASE = "http://quantd.test"


def job_json(job_id: str = "j1", status: str = "queued", *, fraction: float = 0.0,
             sha: str | None = None, nbytes: int = 0) -> dict[str, Any]:
    job: dict[str, Any] = {
        "id": job_id, "status": status, "created_at": "2024-01-01T00:00:00Z",
        "input": {"filename": "m.safetensors", "bytes": 10, "sha256": "0" * 64, "format": "safetensors",
                  "tensors": 1},
        "config": {}, "progress": {"fraction": fraction},
    }
    if sha is not None:
        job["result"] = {"artifact_bytes": nbytes, "artifact_sha256": sha, "summary": summary_json()}
    return job


def summary_json() -> dict[str, Any]:
    return {"tensors_quantized": 1, "tensors_skipped": 0, "input_bytes": 10, "output_bytes": 5,
            "compression_ratio": 2.0, "bits_per_weight": 4.25, "mean_sqnr_db": 20.0, "min_sqnr_db": 20.0,
            "worst_tensor": "w", "elapsed_s": 0.1, "device": "cpu"}


def problem(status: int, detail: str = "nope", **extra: Any) -> httpx.Response:
    body = {"type": "about:blank", "title": "t", "status": status, "detail": detail, **extra}
    return httpx.Response(status, json=body, headers={"content-type": "application/problem+json",
                                                      "x-request-id": f"rid-{status}"})


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class FakeTime:
    """A clock that only moves when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s

    async def asleep(self, s: float) -> None:
        self.sleep(s)


def sync_client(handler: Callable[[httpx.Request], httpx.Response], t: FakeTime | None = None,
                **kw: Any) -> Client:
    c = Client(BASE, transport=httpx.MockTransport(handler), **kw)
    t = t or FakeTime()
    c._sleep, c._clock = t.sleep, t.clock
    c._rand = lambda: 1.0
    return c


def async_client(handler: Callable[[httpx.Request], httpx.Response], t: FakeTime | None = None,
                 **kw: Any) -> AsyncClient:
    c = AsyncClient(BASE, transport=httpx.MockTransport(handler), **kw)
    t = t or FakeTime()
    c._sleep, c._clock = t.asleep, t.clock
    c._rand = lambda: 1.0
    return c


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


class Api:
    """Drives the sync or the async client through one interface, so each test covers both twins."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def client(self, handler: Callable[[httpx.Request], httpx.Response], t: FakeTime | None = None,
               **kw: Any) -> Any:
        return sync_client(handler, t, **kw) if self.mode == "sync" else async_client(handler, t, **kw)

    def call(self, obj: Any, method: str, /, *args: Any, **kw: Any) -> Any:
        result = getattr(obj, method)(*args, **kw)
        return run(result) if asyncio.iscoroutine(result) else result

    def collect(self, it: Any) -> list[Any]:
        if self.mode == "sync":
            return list(it)

        async def go() -> list[Any]:
            return [x async for x in it]

        return run(go())
