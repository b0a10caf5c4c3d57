"""Fixtures of the jobs tests: a small real safetensors model and started services."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from jobs_support import cast_pipeline
from safetensors.torch import save_file

from quantd.jobs import JobsConfig, JobService


@pytest.fixture(scope="session")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {"layer.0.weight": torch.randn(16, 64, generator=g), "layer.1.weight": torch.randn(8, 64, generator=g),
               "layer.1.bias": torch.randn(8, generator=g)}
    path = tmp_path_factory.mktemp("model") / "model.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.fixture
def make_service(tmp_path: Path) -> Iterator[Callable[..., JobService]]:
    services: list[JobService] = []

    def make(*, quantize_fn: Any = cast_pipeline, data_dir: Path | None = None, **overrides: Any) -> JobService:
        settings: dict[str, Any] = {"device": "cpu", "workers": 1, "lease_s": 10.0, "heartbeat_s": 0.5,
                                    "poll_s": 0.05, "events_poll_s": 0.02, "reap_interval_s": 0.05,
                                    "progress_write_s": 0.02}
        settings.update(overrides)
        svc = JobService(JobsConfig(data_dir=data_dir or tmp_path / "data", **settings), quantize_fn=quantize_fn)
        svc.start_sync()
        services.append(svc)
        return svc

    yield make
    for svc in services:
        svc.stop_sync()
