"""A live quantd server for the SDK's happy paths: the test run's shared keyed ``quantd serve`` (tests/conftest.py)."""

from __future__ import annotations

import pytest

from _live import LIVE_API_KEY

API_KEY = LIVE_API_KEY


@pytest.fixture(scope="session")
def api_key() -> str:
    return API_KEY


@pytest.fixture(scope="session")
def live_url(live_keyed_url: str) -> str:
    return live_keyed_url
