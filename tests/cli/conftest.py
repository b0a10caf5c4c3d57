"""A live server for the CLI's ``--server`` paths: the session's open ``quantd serve`` (tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def cli_server(live_open_url: str) -> str:
    return live_open_url
