"""In-process change signals: a worker thread that writes a job's progress or end wakes the event
streams following that job at once, instead of at their next poll of the job row.

Only this process's workers signal; a stream keeps polling the database every ``events_poll_s`` too, so
jobs run by other worker processes (``quantd worker``) are followed as before, just less promptly.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import defaultdict


class JobSignals:
    """``notify(job_id)`` from any thread; ``await wait(job_id, timeout)`` on an event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = defaultdict(set)

    def notify(self, job_id: str) -> None:
        with self._lock:
            waiters = list(self._waiters.get(job_id, ()))
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # that loop closed meanwhile: nobody to wake
                loop.call_soon_threadsafe(event.set)

    def notify_all(self) -> None:
        """Wake every waiter (the server is stopping)."""
        with self._lock:
            ids = list(self._waiters)
        for job_id in ids:
            self.notify(job_id)

    async def wait(self, job_id: str, timeout: float) -> bool:
        """True when ``job_id`` was signalled within ``timeout`` seconds, False on timeout."""
        entry = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._waiters[job_id].add(entry)
        try:
            await asyncio.wait_for(entry[1].wait(), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            with self._lock:
                waiters = self._waiters.get(job_id)
                if waiters is not None:
                    waiters.discard(entry)
                    if not waiters:
                        del self._waiters[job_id]
