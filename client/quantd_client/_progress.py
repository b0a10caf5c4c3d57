"""A small dependency-free progress bar on stderr, used for uploads, job progress and downloads.

``progress`` arguments across the SDK accept: ``None`` (auto: a bar when stderr is a TTY),
``True``/``False``, or a callable ``(done, total)`` that receives the raw numbers instead.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

ProgressCallback = Callable[[float, float | None], None]
ProgressArg = bool | None | ProgressCallback


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover - loop always returns


class ProgressBar:
    """``[#####.....]  42%  12.0 MiB / 28.5 MiB  label`` redrawn in place, at most ~10 times a second, on a
    terminal. On anything else (a log file, a pipe) no carriage returns or escape codes: a plain line
    ``label: 42%  12.0 MiB / 28.5 MiB`` at each quarter of the way (or every ``line_every_s`` seconds when
    the total is unknown), and one when done."""

    def __init__(self, label: str, total: float | None, *, stream: TextIO | None = None,
                 units: str = "bytes", width: int = 30, line_every_s: float = 30.0) -> None:
        self.label = label
        self.total = total
        self.done = 0.0
        self.stream = stream if stream is not None else sys.stderr
        self.units = units
        self.width = width
        self._last_draw = 0.0
        self._closed = False
        self._tty = _isatty(self.stream)
        self.line_every_s = line_every_s
        self._last_quarter = -1
        self._last_line = ""

    def _fmt(self, n: float) -> str:
        if self.units == "bytes":
            return _human(n)
        if self.units == "fraction":
            return f"{n:.0%}"
        return f"{n:.0f}"

    def render(self) -> str:
        if self.total:
            frac = min(1.0, max(0.0, self.done / self.total))
            filled = int(frac * self.width)
            bar = "#" * filled + "." * (self.width - filled)
            amounts = f"{self._fmt(self.done)} / {self._fmt(self.total)}" if self.units != "fraction" else ""
            return f"[{bar}] {frac:4.0%}  {amounts}  {self.label}".rstrip()
        return f"{self._fmt(self.done)}  {self.label}"

    def line(self) -> str:
        """The plain-text form: no bar, no control characters."""
        if self.total:
            frac = min(1.0, max(0.0, self.done / self.total))
            amounts = f"  {self._fmt(self.done)} / {self._fmt(self.total)}" if self.units != "fraction" else ""
            return f"{self.label}: {frac:.0%}{amounts}"
        return f"{self.label}: {self._fmt(self.done)}"

    def _plain(self, now: float) -> None:
        if self.total:
            quarter = int(4 * min(1.0, max(0.0, self.done / self.total)))
            due = quarter > self._last_quarter
            if due:
                self._last_quarter = quarter
        else:
            due = self._last_draw == 0.0 or now - self._last_draw >= self.line_every_s
        if due:
            self._last_draw = now
            self._write_line()

    def _write_line(self) -> None:
        text = self.line()
        if text != self._last_line:
            self._last_line = text
            self.stream.write(text + "\n")
            self.stream.flush()

    def set(self, done: float, total: float | None = None) -> None:
        if total is not None:
            self.total = total
        self.done = done
        now = time.monotonic()
        if not self._tty:
            self._plain(now)
            return
        finished = bool(self.total) and self.done >= (self.total or 0)
        if finished or now - self._last_draw >= 0.1:
            self._last_draw = now
            self.stream.write("\r" + self.render() + "\x1b[K")
            self.stream.flush()

    def update(self, n: float) -> None:
        self.set(self.done + n)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if not self._tty:
                self._write_line()  # the last line says where it ended
                return
            self.stream.write("\r" + self.render() + "\x1b[K\n")
            self.stream.flush()


class Reporter:
    """What an SDK call reports progress to: a bar, a user callback, or nothing."""

    def __init__(self, progress: ProgressArg, label: str, total: float | None, *, units: str = "bytes",
                 stream: TextIO | None = None) -> None:
        self._callback: ProgressCallback | None = None
        self._bar: ProgressBar | None = None
        self.total = total
        self.done = 0.0
        if callable(progress):
            self._callback = progress
        else:
            out = stream if stream is not None else sys.stderr
            enabled = progress if progress is not None else _isatty(out)
            if enabled:
                self._bar = ProgressBar(label, total, stream=out, units=units)

    @property
    def enabled(self) -> bool:
        return self._bar is not None or self._callback is not None

    def set(self, done: float, total: float | None = None) -> None:
        if total is not None:
            self.total = total
        self.done = done
        if self._bar is not None:
            self._bar.set(done, total)
        if self._callback is not None:
            self._callback(done, self.total)

    def update(self, n: float) -> None:
        self.set(self.done + n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
