"""Which tensors of a safetensors file hold NaN or Inf, found while its bytes stream by.

A job's upload is checked before the job is accepted (CONTRACT §2: NaN/Inf weights are a 4xx), without a
second read of a file that may be many gigabytes: the server feeds each chunk of the upload to a
:class:`FiniteScan` as it writes and hashes it, and at submit asks which tensors it found non-finite; any
makes the submit a 422 naming the first. Float tensors are tested on their bit
patterns (an all-ones exponent is NaN or ±Inf), a pass over memory the chunk is already in. Anything the
scan cannot follow (not safetensors, a header it cannot read) ends it quietly: the file's own checks say
what is wrong, and the worker checks every tensor it quantizes in any case.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from quantd.errors import MalformedInputError

from .st_header import MAX_HEADER_BYTES, read_header

# A bound on a file still streaming in: the header's offsets are checked against the bytes later.
_ANY_SIZE = 1 << 62
# The unsigned view of each float dtype and the mask of its exponent bits.
_EXPONENT: dict[str, tuple[np.dtype[np.unsignedinteger], int]] = {
    "F64": (np.dtype("<u8"), 0x7FF0_0000_0000_0000),
    "F32": (np.dtype("<u4"), 0x7F80_0000),
    "F16": (np.dtype("<u2"), 0x7C00),
    "BF16": (np.dtype("<u2"), 0x7F80),
}


@dataclass
class _Span:
    name: str
    begin: int  # absolute offsets in the file
    end: int
    view: np.dtype[np.unsignedinteger]
    mask: int


class FiniteScan:
    """Fed a file's bytes in order (:meth:`feed`); :meth:`non_finite` then names the float tensors with a
    NaN or Inf, or is None when the scan could not follow the file."""

    def __init__(self) -> None:
        self._head = bytearray()
        self._spans: list[_Span] | None = None
        self._next = 0  # index of the first span not yet wholly seen
        self._pos = 0  # absolute offset of the next byte fed
        self._carry = b""  # the bytes of a current span's element split across chunks
        self._bad: list[str] = []
        self._bad_set: set[str] = set()
        self._failed = False

    def feed(self, data: bytes | memoryview) -> None:
        if self._failed:
            return
        try:
            if self._spans is None:
                data = self._read_header(data)
                if self._spans is None or self._failed:
                    return
            self._scan(memoryview(data))
        except Exception:  # a header no reader takes (an Infinity offset...): its own checks say what is wrong
            self._fail()

    def _fail(self) -> None:
        self._failed = True
        self._head = bytearray()  # nothing more is held for a file the scan gave up on

    def non_finite(self) -> list[str] | None:
        """The tensors holding NaN or Inf, in file order; None if the file was not followed to its end."""
        if self._failed or self._spans is None or self._next < len(self._spans):
            return None
        return list(self._bad)

    def _read_header(self, data: bytes | memoryview) -> bytes | memoryview:
        """Gathers the length and header; returns what of ``data`` lies after the header."""
        start = len(self._head)
        self._head += data
        if len(self._head) < 8:
            return b""
        n = int.from_bytes(self._head[:8], "little")
        if n > MAX_HEADER_BYTES:
            self._fail()
            return b""
        if len(self._head) < 8 + n:
            return b""
        try:  # the reader's own parsing and checks (counts, offsets, overlaps); the data section unseen yet
            header = read_header(io.BytesIO(bytes(self._head[:8 + n])), file_size=_ANY_SIZE)
        except MalformedInputError:
            self._fail()  # the upload's own checks will say what is wrong with it
            return b""
        spans = sorted((_Span(e.name, header.data_start + e.begin, header.data_start + e.end, *_EXPONENT[e.dtype])
                        for e in header.entries.values() if e.dtype in _EXPONENT and e.end > e.begin),
                       key=lambda s: s.begin)  # (an empty tensor holds nothing to test)
        self._spans = spans
        self._pos = 8 + n
        consumed = 8 + n - start  # the bytes of this chunk that were header
        rest = memoryview(data)[consumed:]
        self._head = bytearray()
        return rest

    def _scan(self, data: memoryview) -> None:
        spans = self._spans
        assert spans is not None
        pos, end = self._pos, self._pos + len(data)
        while self._next < len(spans) and spans[self._next].begin < end:
            span = spans[self._next]
            lo, hi = max(span.begin, pos), min(span.end, end)
            if hi > lo:
                piece = data[lo - pos:hi - pos]
                if span.name not in self._bad_set:
                    self._check(span, piece)
            if span.end > end:
                break
            self._next += 1
            self._carry = b""
        self._pos = end

    def _check(self, span: _Span, piece: memoryview) -> None:
        size = span.view.itemsize
        buf: bytes | memoryview = self._carry + bytes(piece) if self._carry else piece
        whole = len(buf) - len(buf) % size
        self._carry = bytes(buf[whole:])
        if whole == 0:
            return
        bits = np.frombuffer(buf, dtype=span.view, count=whole // size)
        if bool(np.any((bits & span.mask) == span.mask)):
            self._bad.append(span.name)
            self._bad_set.add(span.name)
