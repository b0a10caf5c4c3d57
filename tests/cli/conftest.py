"""A live server for the CLI's ``--server`` paths: the test run's shared open ``quantd serve`` (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def cli_server(live_open_url: str) -> str:
    return live_open_url


@pytest.fixture(autouse=True)
def _kernels_as_configured() -> Iterator[None]:
    """An in-process CLI run may turn the compiled kernels off for its process (a small input): not for
    the tests after it."""
    yield
    from quantd.engine.kernels import KERNELS

    KERNELS.reset()
