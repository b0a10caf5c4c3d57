"""Real servers for the backend tests, started once per test run: PostgreSQL and moto's S3 server.
A test that needs one is skipped, with the reason, only where it cannot start."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from servers import Postgres, S3Server, Unavailable, postgres, s3_server


@pytest.fixture(scope="session")
def pg_server() -> Iterator[Postgres]:
    try:
        with postgres() as server:
            yield server
    except Unavailable as e:
        pytest.skip(f"PostgreSQL could not start: {e}")


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    try:
        with s3_server() as server:
            yield server
    except Unavailable as e:
        pytest.skip(f"S3 endpoint could not start: {e}")


@pytest.fixture
def pg_url(pg_server: Postgres) -> str:
    """A fresh, empty database on the shared server."""
    return pg_server.create_database(f"t_{uuid.uuid4().hex[:12]}")


@pytest.fixture
def bucket(s3: S3Server) -> str:
    name = f"quantd-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(name)
    return name


@pytest.fixture
def replicas(pg_url: str, bucket: str, s3: S3Server, tmp_path: Path) -> Callable[..., Any]:
    """``async with replicas(spec, ...) as clients``: one in-process API replica per spec, all on the test's
    database and bucket; a spec's settings override ``defaults``, and ``headers`` go with every request."""
    from quantd.server.app import create_app
    from quantd.server.settings import Settings

    @asynccontextmanager
    async def start(*specs: dict[str, Any], defaults: dict[str, Any] | None = None,
                    headers: dict[str, str] | None = None) -> AsyncIterator[list[httpx.AsyncClient]]:
        async with AsyncExitStack() as stack:
            clients = []
            for i, spec in enumerate(specs):
                settings = Settings(data_dir=tmp_path / f"replica{i}", device="cpu", log_level="WARNING",
                                    warmup=False, database_url=pg_url, storage_url=f"s3://{bucket}/quantd",
                                    s3_endpoint_url=s3.endpoint, **{**(defaults or {}), **spec})
                app = create_app(settings)
                await stack.enter_async_context(app.router.lifespan_context(app))
                transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
                clients.append(await stack.enter_async_context(
                    httpx.AsyncClient(transport=transport, base_url=f"http://replica{i}", headers=headers)))
            yield clients

    return start
