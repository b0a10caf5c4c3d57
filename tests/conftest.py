from __future__ import annotations

from collections.abc import Iterator

import pytest


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
