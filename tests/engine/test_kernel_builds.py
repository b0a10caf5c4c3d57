"""Kernel variants a server's warm-up did not build: the request runs eager, a background thread builds them."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from quantd.engine import kernels


def test_after_the_warm_up_a_new_variant_runs_eager_while_a_background_thread_builds_it() -> None:
    """A server's request or job never waits on a compile: the first call of a variant the warm-up did not
    build answers None (the caller runs eager) and queues the build; a later call takes the built kernel."""
    compiled = kernels._Compiled()
    if not compiled.available():
        pytest.skip("the compiled kernels are off here (QUANTD_COMPILE=0, or no C++ compiler)")
    started: list[str] = []
    compiled.build_in_background(lambda: started.append(threading.current_thread().name))

    def twice_plus_one(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    x = torch.arange(4096, dtype=torch.float32)
    assert compiled.call("twice_plus_one", twice_plus_one, (), x) is None  # eager this time: not waited on
    deadline = time.monotonic() + 300
    out = None
    while out is None and time.monotonic() < deadline:
        time.sleep(0.2)  # poll step while the background thread compiles
        out = compiled.call("twice_plus_one", twice_plus_one, (), x)
    assert out is not None and torch.equal(out, x * 2 + 1)
    assert started and started[0].startswith("quantd-kernel-build")
    with compiled.building():  # a warm-up's own thread compiles what it meets, background or not
        y = torch.arange(4096, dtype=torch.float64)
        assert torch.equal(compiled.call("twice_plus_one", twice_plus_one, ("f64",), y), y * 2 + 1)
    view = torch.arange(1 << 16, dtype=torch.float32)[: 1 << 12]
    assert compiled.call("twice_plus_one", twice_plus_one, ("view",), view) is None  # queued with its own copy
    compiled.reset()  # a reset drops the builder and what was queued: first calls compile in the caller again
    assert not compiled._pending and compiled._builder is None
    assert torch.equal(compiled.call("twice_plus_one", twice_plus_one, ("after reset",), x), x * 2 + 1)
