"""Job handles: a Job model plus the client that can refresh, wait on, download and report it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ._base import TERMINAL_STATUSES, ServerSentEvent, event_fraction, hash_existing
from ._exceptions import (
    APIConnectionError,
    APIStatusError,
    AuthError,
    JobTimeout,
    ServerError,
    ValidationError,
)
from ._progress import ProgressArg, Reporter
from ._schemas import FileEntry, Job, JobError, JobResult, JobStatus, Progress, Report

if TYPE_CHECKING:
    from ._async import AsyncClient
    from ._client import Client

POLL_FIRST = 0.5
POLL_FACTOR = 1.5
POLL_MAX = 5.0
# A wait without a timeout gives up after the server has been unreachable this long (a restart takes seconds).
UNREACHABLE_MAX_S = 300.0
# What a proxy in front of a restarting server answers.
_RESTARTING = frozenset({502, 503, 504})


def _still_down(job_id: str, error: APIConnectionError | ServerError, since: float | None, now: float,
                deadline: float | None) -> float:
    """When the server became unreachable (``since``, or ``now`` at the first failure) while a wait polls
    job ``job_id``; ``error`` goes up when it is no restart (a 5xx other than a proxy's 502/503/504), and
    JobTimeout at the wait's deadline, or ``error`` after :data:`UNREACHABLE_MAX_S` without one: each poll
    alone gives up after the client's retries (seconds, shorter than a restart)."""
    if isinstance(error, ServerError) and error.status not in _RESTARTING:
        raise error
    since = now if since is None else since
    if deadline is not None and now >= deadline:
        raise JobTimeout(f"job {job_id}: the server was unreachable at the timeout") from error
    if deadline is None and now - since > UNREACHABLE_MAX_S:
        raise error
    return since


def _next_keepalive_late(deadline: float | None, now: float, last: float) -> bool:
    """A wait with a deadline leaves the event stream at a keep-alive when the next one, as far apart as this
    one from the line before, would come after the deadline: the stream's read timeout only measures the
    gaps between lines, which keep-alives reset."""
    return deadline is not None and now + (now - last) >= deadline


class _HandleBase:
    model: Job

    @property
    def id(self) -> str:
        return self.model.id

    @property
    def status(self) -> JobStatus:
        return self.model.status

    @property
    def progress(self) -> Progress:
        return self.model.progress

    @property
    def result(self) -> JobResult | None:
        return self.model.result

    @property
    def error(self) -> JobError | None:
        return self.model.error

    @property
    def done(self) -> bool:
        return self.model.status in TERMINAL_STATUSES

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, status={self.status!r}, fraction={self.progress.fraction:.2f})"

    def _expected_sha(self) -> str | None:
        return self.model.result.artifact_sha256 if self.model.result else None

    def _output_files(self, out_dir: Path) -> list[tuple[FileEntry, Path]] | None:
        """A directory output's files and where each goes under ``out_dir`` (None: a one-file artifact).
        A path that would leave ``out_dir`` is refused, whatever the server says."""
        result = self.model.result
        if result is None or result.files is None:
            return None
        root = out_dir.resolve()
        plan = []
        for f in result.files:
            parts = f.path.split("/")
            target = (root / f.path).resolve()
            if f.path.startswith("/") or "\\" in f.path or any(p in ("", ".", "..") for p in parts) \
                    or not target.is_relative_to(root):
                raise ValidationError(f"job {self.id}: output path {f.path!r} is not a relative path")
            plan.append((f, target))
        return plan


    def _on_event(self, event: ServerSentEvent, reporter: Reporter, deadline: float | None, now: float) -> bool:
        """One SSE event of /events: progress moves the bar; True on the terminal event."""
        if event.event == "progress":
            frac = event_fraction(event.json())
            if frac is not None:
                reporter.set(frac)
        elif event.event in TERMINAL_STATUSES:
            return True
        if deadline is not None and now >= deadline:
            raise JobTimeout(f"job {self.id} still {self.status} after the timeout")
        return False


class JobHandle(_HandleBase):
    """A job on the server, as last seen (``.model``). Methods talk to the server."""

    def __init__(self, client: Client, model: Job) -> None:
        self._client = client
        self.model = model

    def refresh(self) -> JobHandle:
        self.model = self._client._get_job_model(self.id)
        return self

    def wait(self, timeout: float | None = None, progress: ProgressArg = None) -> JobHandle:
        """Block until the job succeeds, fails or is cancelled; follows ``/events`` and falls back to
        polling with backoff. Raises :class:`JobTimeout` after ``timeout`` seconds."""
        c = self._client
        deadline = None if timeout is None else c._clock() + timeout
        reporter = Reporter(progress, f"job {self.id}", 1.0, units="fraction")
        try:
            if not self.done:
                if self._follow_events(deadline, reporter):
                    self.refresh()  # the terminal event's job, with its result or error
                else:
                    self._poll(deadline, reporter)
            if self.model.status == "succeeded":
                reporter.set(1.0)
        finally:
            reporter.close()
        return self

    def _follow_events(self, deadline: float | None, reporter: Reporter) -> bool:
        c = self._client
        remaining = None if deadline is None else max(0.0, deadline - c._clock())
        last = c._clock()
        try:
            for event in c._events(self.id, remaining):
                now = c._clock()
                if event is None:
                    if _next_keepalive_late(deadline, now, last):
                        return False  # polling stops at the deadline; the stream's next line may come after it
                elif self._on_event(event, reporter, deadline, now):
                    return True
                last = now
        except (APIConnectionError, APIStatusError, ValueError) as e:
            if isinstance(e, AuthError):
                raise  # polling would fail the same way; anything else falls back to polling
        return False

    def _poll(self, deadline: float | None, reporter: Reporter) -> None:
        c = self._client
        delay = POLL_FIRST
        down_since: float | None = None
        while True:
            try:
                self.refresh()
                down_since = None
            except (APIConnectionError, ServerError) as e:  # a restart: the job lives on; poll again, a while
                down_since = _still_down(self.id, e, down_since, c._clock(), deadline)
            reporter.set(self.progress.fraction)
            if self.done:
                return
            now = c._clock()
            if deadline is not None and now >= deadline:
                raise JobTimeout(f"job {self.id} still {self.status} after the timeout")
            c._sleep(delay if deadline is None else min(delay, deadline - now))
            delay = min(delay * POLL_FACTOR, POLL_MAX)

    def download(self, path: str | os.PathLike[str], progress: ProgressArg = None) -> Path:
        """Stream the artifact to ``path`` (via ``path.part``, resumable), sha256-checked. A directory output
        (a model directory job, or a format that writes one) is written as the directory ``path``, file by
        file, each sha256-checked; files already there and whole are kept, a partial one is resumed."""
        plan = self._output_files(Path(path))
        if plan is None:
            return self._client._download(self.id, path, self._expected_sha(), progress)
        for f, target in plan:
            if not _have(target, f):
                target.parent.mkdir(parents=True, exist_ok=True)
                self._client._download(self.id, target, f.sha256, progress, file=f.path)
        return Path(path)

    def report(self) -> Report:
        return self._client._report(self.id)

    def cancel(self) -> JobHandle:
        handle = self._client.cancel(self.id)
        if handle is not None:
            self.model = handle.model
        return self


class AsyncJobHandle(_HandleBase):
    """The :class:`JobHandle` of :class:`AsyncClient`; the same methods, awaited."""

    def __init__(self, client: AsyncClient, model: Job) -> None:
        self._client = client
        self.model = model

    async def refresh(self) -> AsyncJobHandle:
        self.model = await self._client._get_job_model(self.id)
        return self

    async def wait(self, timeout: float | None = None, progress: ProgressArg = None) -> AsyncJobHandle:
        c = self._client
        deadline = None if timeout is None else c._clock() + timeout
        reporter = Reporter(progress, f"job {self.id}", 1.0, units="fraction")
        try:
            if not self.done:
                if await self._follow_events(deadline, reporter):
                    await self.refresh()  # the terminal event's job, with its result or error
                else:
                    await self._poll(deadline, reporter)
            if self.model.status == "succeeded":
                reporter.set(1.0)
        finally:
            reporter.close()
        return self

    async def _follow_events(self, deadline: float | None, reporter: Reporter) -> bool:
        c = self._client
        remaining = None if deadline is None else max(0.0, deadline - c._clock())
        last = c._clock()
        try:
            async for event in c._events(self.id, remaining):
                now = c._clock()
                if event is None:
                    if _next_keepalive_late(deadline, now, last):
                        return False  # polling stops at the deadline; the stream's next line may come after it
                elif self._on_event(event, reporter, deadline, now):
                    return True
                last = now
        except (APIConnectionError, APIStatusError, ValueError) as e:
            if isinstance(e, AuthError):
                raise  # polling would fail the same way; anything else falls back to polling
        return False

    async def _poll(self, deadline: float | None, reporter: Reporter) -> None:
        c = self._client
        delay = POLL_FIRST
        down_since: float | None = None
        while True:
            try:
                await self.refresh()
                down_since = None
            except (APIConnectionError, ServerError) as e:  # a restart: the job lives on; poll again, a while
                down_since = _still_down(self.id, e, down_since, c._clock(), deadline)
            reporter.set(self.progress.fraction)
            if self.done:
                return
            now = c._clock()
            if deadline is not None and now >= deadline:
                raise JobTimeout(f"job {self.id} still {self.status} after the timeout")
            await c._sleep(delay if deadline is None else min(delay, deadline - now))
            delay = min(delay * POLL_FACTOR, POLL_MAX)

    async def download(self, path: str | os.PathLike[str], progress: ProgressArg = None) -> Path:
        """As :meth:`JobHandle.download`."""
        plan = self._output_files(Path(path))
        if plan is None:
            return await self._client._download(self.id, path, self._expected_sha(), progress)
        for f, target in plan:
            if not _have(target, f):
                target.parent.mkdir(parents=True, exist_ok=True)
                await self._client._download(self.id, target, f.sha256, progress, file=f.path)
        return Path(path)

    async def report(self) -> Report:
        return await self._client._report(self.id)

    async def cancel(self) -> AsyncJobHandle:
        handle = await self._client.cancel(self.id)
        if handle is not None:
            self.model = handle.model
        return self


def _have(target: Path, f: FileEntry) -> bool:
    """``target`` already holds ``f`` (a download resumed after some files were written)."""
    if not target.is_file() or target.stat().st_size != f.bytes:
        return False
    digest, _ = hash_existing(target)
    return bool(digest.hexdigest() == f.sha256)
