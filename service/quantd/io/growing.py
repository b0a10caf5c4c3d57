"""Reading a file while another thread is still appending to it (an upload being received).

``GrowingFile`` is the reader's side: a read that reaches past what the writer has announced waits
for it, so a model reader can parse a safetensors header and load tensor after tensor as their bytes
land. The writer announces progress with :meth:`advance` (after its bytes are visible to other file
descriptors: flushed), and ends with :meth:`complete` (no more bytes) or :meth:`abort`. After
``complete`` reads behave as on a plain file (a short read at the end); after ``abort`` every read
that would wait raises :class:`UploadAborted`.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Literal


class UploadAborted(Exception):
    """The file's writer gave up (a failed upload, a cancelled job): its content will not come."""


class GrowingFile:
    """A binary, seekable, read-only view of a file that is being appended to. Thread-safe between
    one writer (``advance``/``complete``/``abort``) and one reader (``read``/``readinto``/``seek``)."""

    def __init__(self, path: Path) -> None:
        self._f = open(path, "rb")  # noqa: SIM115 - closed by close()
        self._cond = threading.Condition()
        self._available = 0
        self._state: Literal["open", "complete", "aborted"] = "open"
        self.last_advance = time.monotonic()  # when the writer last moved (or ended)

    # -- the writer's side --------------------------------------------------------------------
    def advance(self, nbytes: int) -> None:
        """The first ``nbytes`` of the file are written and readable."""
        with self._cond:
            self.last_advance = time.monotonic()
            if nbytes > self._available:
                self._available = nbytes
                self._cond.notify_all()

    def complete(self) -> None:
        """Nothing more will be written."""
        with self._cond:
            self.last_advance = time.monotonic()
            if self._state == "open":
                self._state = "complete"
            self._cond.notify_all()

    def abort(self) -> None:
        """The content will not come (or is no longer wanted): waiting reads raise UploadAborted."""
        with self._cond:
            self._state = "aborted"
            self._cond.notify_all()

    # -- the reader's side --------------------------------------------------------------------
    @property
    def completed(self) -> bool:
        return self._state == "complete"

    def _wait_for(self, end: int) -> None:
        with self._cond:
            while self._available < end and self._state == "open":
                self._cond.wait()
            if self._state == "aborted":
                raise UploadAborted("the upload ended before its data arrived")

    def final_size(self) -> int:
        """The file's size once the writer has completed it (waits for that)."""
        with self._cond:
            while self._state == "open":
                self._cond.wait()
            if self._state == "aborted":
                raise UploadAborted("the upload ended before it was complete")
        return os.fstat(self._f.fileno()).st_size

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence != os.SEEK_SET:
            raise ValueError("GrowingFile seeks from the start only")
        return self._f.seek(offset)

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, buffer: memoryview) -> int:
        view = memoryview(buffer).cast("B")
        self._wait_for(self._f.tell() + len(view))
        return self._f.readinto(view)

    def read(self, size: int) -> bytes:
        self._wait_for(self._f.tell() + size)
        return self._f.read(size)

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        self._f.close()
