"""Chunk loops spread over CPU threads, each chunk's torch ops single-threaded.

Eager torch splits every CPU op over its intra-op (OpenMP) threads and joins them at the end of the op.
The engine's chunk loops run dozens of small ops on each cache-sized chunk; when other processes keep the
cores busy, each join waits for a thread the scheduler has set aside (a time slice, milliseconds), and an op
of tens of microseconds takes milliseconds. Here a chunk's ops run in one thread, and the chunks are handed
out to :func:`workers` threads as they finish: a thread that is set aside delays only its own chunk.

CUDA tensors, single chunks and calls from inside a chunk run in the calling thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_workers: int | None = None
_local = threading.local()


def workers() -> int:
    """Threads of the chunk pool: torch's intra-op thread count when first asked (``torch.set_num_threads``,
    ``OMP_NUM_THREADS``), fixed from then on."""
    global _workers
    with _lock:
        if _workers is None:
            _workers = max(1, torch.get_num_threads())
        return _workers


def _start_thread() -> None:
    torch.set_num_threads(1)  # OpenMP's thread count is per calling thread: the caller's stays as it is
    _local.in_pool = True


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    n = workers()
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(n, thread_name_prefix="quantd-chunks", initializer=_start_thread)
        return _pool


def map_chunks(fn: Callable[[int], T], count: int, device: torch.device) -> list[T]:
    """``[fn(0), …, fn(count − 1)]``, the calls spread over the chunk pool for CPU work (in order of the
    indices, results in that order); ``fn`` must write only to what chunk ``i`` owns. Runs in the calling
    thread for CUDA, for one chunk, with one worker, or when called from a chunk."""
    if device.type != "cpu" or count < 2 or getattr(_local, "in_pool", False) or workers() < 2:
        return [fn(i) for i in range(count)]
    return list(_get_pool().map(fn, range(count)))


def single_threaded_caller() -> int:
    """Make this thread's own torch ops single-threaded (a one-shot run's main thread), after fixing the
    pool's size at the intra-op thread count (:func:`workers`), which it returns: the parallel work then
    happens in chunk loops only, with no join per op."""
    n = workers()
    torch.set_num_threads(1)
    return n


@contextlib.contextmanager
def caller_single_threaded() -> Iterator[None]:
    """For the ``with`` block, this thread's own torch ops run single-threaded (the pool's size is fixed
    first, :func:`workers`); the thread count is restored after. For work of many small ops per chunk, where
    an OpenMP join per op, or its threads spinning beside the chunk pool, costs more than the op."""
    workers()
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
