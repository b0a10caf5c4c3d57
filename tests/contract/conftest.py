"""The shared open server for every contract module (helpers live in ``_harness``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ._harness import Server, start_server, stop_server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One open server (no API keys) shared by every contract module."""
    srv = start_server(tmp_path_factory.mktemp("contract-open"), {})
    yield srv
    stop_server(srv)
