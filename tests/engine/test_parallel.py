"""The chunk pool: results in order, single-threaded ops inside, the caller's threads untouched."""

from __future__ import annotations

import threading

import pytest
import torch

from quantd.engine import parallel


@pytest.fixture
def two_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "_workers", max(2, parallel.workers()))


def test_results_in_order_from_the_pool_threads(two_workers: None) -> None:
    before = torch.get_num_threads()
    seen: list[tuple[str, int]] = []

    def fn(i: int) -> int:
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return i * i

    assert parallel.map_chunks(fn, 50, torch.device("cpu")) == [i * i for i in range(50)]
    assert all(name.startswith("quantd-chunks") and threads == 1 for name, threads in seen)
    assert torch.get_num_threads() == before


def test_inline_for_other_devices_single_chunks_and_nested_calls(two_workers: None) -> None:
    caller = threading.current_thread().name
    names: list[str] = []

    def record(i: int) -> int:
        names.append(threading.current_thread().name)
        return i

    assert parallel.map_chunks(record, 3, torch.device("meta")) == [0, 1, 2]
    assert parallel.map_chunks(record, 1, torch.device("cpu")) == [0]
    assert names == [caller] * 4

    def outer(i: int) -> list[str]:
        here = threading.current_thread().name
        return [here, *parallel.map_chunks(lambda _: threading.current_thread().name, 3, torch.device("cpu"))]

    for group in parallel.map_chunks(outer, 4, torch.device("cpu")):
        assert len(set(group)) == 1  # a chunk's own chunks run in its thread: no wait on the pool it is in


def test_an_error_in_a_chunk_reaches_the_caller(two_workers: None) -> None:
    def fn(i: int) -> int:
        if i == 7:
            raise ValueError("chunk 7")
        return i

    with pytest.raises(ValueError, match="chunk 7"):
        parallel.map_chunks(fn, 20, torch.device("cpu"))


def test_caller_single_threaded_restores_the_thread_count() -> None:
    from quantd.engine.parallel import caller_single_threaded

    before = torch.get_num_threads()
    with caller_single_threaded():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
