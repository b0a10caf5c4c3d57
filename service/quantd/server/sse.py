"""Server-sent events from the jobs layer's event iterator, with keep-alive comments."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})


def format_event(event: str, data: Any) -> bytes:
    payload = json.dumps(data, separators=(",", ":"), default=str)
    return f"event: {event}\ndata: {payload}\n\n".encode()


async def sse_stream(events: AsyncIterator[tuple[str, Any]], *, keepalive_s: float) -> AsyncIterator[bytes]:
    """Each ``(event, data)`` as an SSE frame; a ``: keep-alive`` comment after ``keepalive_s`` of
    silence; ends after the first terminal event. The pending read is never cancelled by a
    keep-alive tick (cancelling an async generator mid-step would close it)."""
    it = events.__aiter__()
    pending: asyncio.Future[tuple[str, Any]] | None = None
    try:
        yield b": stream open\n\n"
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=keepalive_s)
            if not done:
                yield b": keep-alive\n\n"
                continue
            try:
                event, data = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield format_event(event, data)
            if event in TERMINAL:
                return
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
