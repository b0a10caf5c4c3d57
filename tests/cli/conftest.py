"""A live server for the CLI's ``--server`` paths: ``python -m quantd serve`` on a free loopback port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from _live import live_server


@pytest.fixture(scope="session")
def cli_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with live_server(tmp_path_factory.mktemp("cli-live"), port_from_env=True) as base:
        yield base


@pytest.fixture(autouse=True)
def _kernels_as_configured() -> Iterator[None]:
    """An in-process CLI run may turn the compiled kernels off for its process (a small input): not for
    the tests after it."""
    yield
    from quantd.engine.kernels import KERNELS

    KERNELS.reset()
