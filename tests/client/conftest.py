"""A live quantd server for the SDK's happy paths: ``python -m quantd serve`` on a free loopback port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from _live import live_server

API_KEY = "sdk-test-key-0001"


@pytest.fixture(scope="session")
def api_key() -> str:
    return API_KEY


@pytest.fixture(scope="session")
def live_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with live_server(tmp_path_factory.mktemp("sdk-live"), api_keys=f"sdk:{API_KEY}") as base:
        yield base
