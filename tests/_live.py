"""The test suite's live server: :func:`quantd.testing.live_server` with the settings every test wants."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from quantd.testing import free_port
from quantd.testing import live_server as _live_server

__all__ = ["LIVE_API_KEY", "free_port", "inductor_cache_dir", "live_server"]

# The key of the test run's keyed live server (tests/conftest.py's live_keyed_url).
LIVE_API_KEY = "sdk-test-key-0001"


def inductor_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


@contextmanager
def live_server(root: Path, *, api_keys: str | None = None, port_from_env: bool = False,
                env: dict[str, str] | None = None, workers: int = 1, ready_path: str = "/readyz",
                timeout_s: float = 90.0) -> Iterator[str]:
    """A ``quantd serve`` with data under ``root`` and none of this shell's ``QUANTD_*`` settings; yields
    its URL once ready. No background kernel warm-up competing with the tests (test_uvicorn checks it),
    and the compiled kernels' cache shared with the test process (serve's default is one in its data dir,
    which would compile every kernel afresh in each live server)."""
    extra = {"QUANTD_WARMUP": "0", "TORCHINDUCTOR_CACHE_DIR": inductor_cache_dir(), **(env or {})}
    if api_keys:
        extra["QUANTD_API_KEYS"] = api_keys
    with _live_server(root, env=extra, workers=workers, port_from_env=port_from_env, ready_path=ready_path,
                      timeout_s=timeout_s) as server:
        yield server.url
