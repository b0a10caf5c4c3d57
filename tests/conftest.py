from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# The suite compiles kernels on tiny and odd shapes (the `compiled` fixture below). Inductor fixes a
# dynamic-shape kernel's code at its first call (vector width, serial or parallel) and shares it through its
# disk cache, so the tests keep a cache of their own (kept between runs: warm runs stay fast) instead of
# leaving such kernels to the servers and benchmarks of this machine. Subprocesses inherit it.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      str(Path(tempfile.gettempdir()) / f"quantd-tests-inductor-{os.getuid()}"))
# The CLI's in-process runs set glibc's malloc for the whole process (quantd.runtime.keep_freed_memory):
# not for pytest's own, which runs everything else. Its test turns it on in subprocesses.
os.environ.setdefault("QUANTD_KEEP_FREED_MEMORY", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def hf_offline() -> Iterator[None]:
    """transformers and the Hugging Face hub offline for a module (``pytestmark = usefixtures``): its models
    come from the tests' own files, and nothing is ever downloaded."""
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    before = {k: os.environ.get(k) for k in keys}
    os.environ.update(dict.fromkeys(keys, "1"))
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every tensor through the fused compiled kernels, whatever its size."""
    from quantd.engine import kernels

    monkeypatch.setattr(kernels, "MIN_ELEMENTS", 0)
    kernels.KERNELS.reset(available=True)
    yield
    assert kernels.KERNELS._broken is None, kernels.KERNELS._broken  # compiled, not silently fallen back
    kernels.KERNELS.reset()


@pytest.fixture
def eager() -> Iterator[None]:
    """Every tensor through the eager torch ops."""
    from quantd.engine import kernels

    kernels.KERNELS.reset(available=False)
    yield
    kernels.KERNELS.reset()


# Live ``quantd serve`` processes shared by the whole test run (the CLI's --server paths, the SDK's happy
# paths, the OpenAPI conformance run): one open, one with API keys, each started once.
@pytest.fixture(scope="session")
def live_open_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from _live import live_server

    # The port through QUANTD_PORT: serve's flags default from QUANTD_* (test_cli checks it works).
    with live_server(tmp_path_factory.mktemp("live-open"), port_from_env=True) as base:
        yield base


@pytest.fixture(scope="session")
def live_keyed_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from _live import LIVE_API_KEY, live_server

    with live_server(tmp_path_factory.mktemp("live-keyed"), api_keys=f"sdk:{LIVE_API_KEY}") as base:
        yield base
