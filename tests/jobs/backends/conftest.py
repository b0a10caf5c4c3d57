"""Real servers for the backend tests, started once per session: PostgreSQL and moto's S3 server.
A test that needs one is skipped, with the reason, only where it cannot start."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

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
    """A fresh, empty database on the session's server."""
    return pg_server.create_database(f"t_{uuid.uuid4().hex[:12]}")


@pytest.fixture
def bucket(s3: S3Server) -> str:
    name = f"quantd-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(name)
    return name
