"""The SSE framing: keep-alive comments during silence, and nothing after the terminal event."""

from __future__ import annotations

import json

import anyio

from quantd.server.sse import format_event, sse_stream


async def _events(gap_s: float):
    yield "progress", {"fraction": 0.5}
    await anyio.sleep(gap_s)  # a silent job
    yield "succeeded", {"id": "j"}
    yield "progress", {"fraction": 2.0}  # must never be sent


async def test_keepalive_during_silence_and_end_after_terminal():
    frames = [f async for f in sse_stream(_events(0.3), keepalive_s=0.05)]
    events = [f for f in frames if f.startswith(b"event:")]
    assert events == [format_event("progress", {"fraction": 0.5}), format_event("succeeded", {"id": "j"})]
    assert frames[-1] == events[-1]
    assert frames.count(b": keep-alive\n\n") >= 2


async def test_no_keepalive_when_events_flow():
    frames = [f async for f in sse_stream(_events(0.0), keepalive_s=5.0)]
    assert b": keep-alive\n\n" not in frames


def test_event_framing():
    frame = format_event("failed", {"detail": "line1\nline2"})
    head, data, end = frame.split(b"\n", 2)
    assert head == b"event: failed" and end == b"\n"
    assert json.loads(data.removeprefix(b"data: ")) == {"detail": "line1\nline2"}
