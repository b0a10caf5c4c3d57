"""Parse and validate a safetensors header before any tensor byte is touched.

Layout: ``u64 little-endian N`` | ``N bytes of UTF-8 JSON`` (may be padded with spaces) | data.
Every entry is ``name -> {"dtype", "shape", "data_offsets": [begin, end]}`` with offsets relative
to the start of the data section; ``__metadata__`` is an optional ``str -> str`` map.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from quantd.errors import MalformedInputError, check_unicode

from .formats import ST_ITEMSIZE

if TYPE_CHECKING:
    from .growing import GrowingFile

MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_TENSORS = 131_072
# Keys, list items and nestings of a header (``:``, ``,``, ``[``, ``{`` outside strings): an entry of a
# 4-D tensor has 15; the rest is room for ``__metadata__``.
MAX_STRUCTURE = 24 * MAX_TENSORS
_STRUCTURAL = np.zeros(256, dtype=bool)
_STRUCTURAL[[ord(c) for c in ":,[{"]] = True
MAX_NDIM = 64


@dataclass(frozen=True)
class STEntry:
    name: str
    dtype: str  # safetensors spelling: F32, BF16, I64, ...
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class STHeader:
    header_len: int
    data_start: int  # absolute file offset of the data section
    data_size: int
    entries: dict[str, STEntry]  # in header order
    metadata: dict[str, str] = field(default_factory=dict)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _entry(name: str, raw: Any, data_size: int) -> STEntry:
    if not isinstance(raw, dict):
        raise MalformedInputError(f"tensor {name!r}: header entry is not an object", tensor=name)
    dtype, shape, offsets = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ST_ITEMSIZE:
        raise MalformedInputError(
            f"tensor {name!r}: unknown dtype {dtype!r} (expected one of {sorted(ST_ITEMSIZE)})", tensor=name
        )
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_int(s) and s >= 0 for s in shape):
        raise MalformedInputError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative ints",
                                  tensor=name)
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)):
        raise MalformedInputError(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]", tensor=name)
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise MalformedInputError(
            f"tensor {name!r}: data_offsets [{begin}, {end}] outside the data section of {data_size} bytes "
            "(truncated file or lying header)", tensor=name)
    expected = math.prod(shape) * ST_ITEMSIZE[dtype]
    if end - begin != expected:
        raise MalformedInputError(
            f"tensor {name!r}: data_offsets span {end - begin} bytes but shape {shape} of {dtype} needs "
            f"{expected}", tensor=name)
    return STEntry(name, dtype, tuple(shape), begin, end)


def _check_overlaps(entries: dict[str, STEntry]) -> None:
    spans = sorted((e for e in entries.values() if e.nbytes > 0), key=lambda e: (e.begin, e.end))
    for prev, cur in itertools.pairwise(spans):
        if cur.begin < prev.end:
            raise MalformedInputError(
                f"tensor {cur.name!r}: data range [{cur.begin}, {cur.end}) overlaps tensor {prev.name!r} "
                f"[{prev.begin}, {prev.end})", tensor=cur.name)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """JSON objects with a repeated key would hide one entry: refused."""
    seen: set[str] = set()
    for k, _ in pairs:
        if k in seen:
            raise ValueError(f"key {k!r} appears twice")
        seen.add(k)
    return dict(pairs)


def structure_count(raw: bytes) -> int:
    """``:``, ``,``, ``[`` and ``{`` outside JSON strings, in a few vectorised passes (a few times the header's
    bytes of memory, no Python object per token): escapes are dropped, then every quote left opens or closes
    a string, and a byte lies inside one where the running count of quotes is odd."""
    bare = np.frombuffer(raw.replace(b"\\\\", b"").replace(b'\\"', b""), dtype=np.uint8)
    inside = np.cumsum(bare == ord('"'), dtype=np.uint8) & 1  # (mod 256 keeps the parity)
    return int(np.count_nonzero(_STRUCTURAL[bare] & (inside == 0)))


def read_header(f: BinaryIO | GrowingFile, file_size: int | None = None) -> STHeader:
    """Read and validate the header of the open safetensors file ``f`` (positioned anywhere).
    ``file_size``: the file's size (default: ``fstat``), or a bound on it for a file still growing."""
    if file_size is None:
        file_size = os.fstat(f.fileno()).st_size
    f.seek(0)
    prefix = f.read(8)
    if len(prefix) < 8:
        raise MalformedInputError(f"safetensors file of {file_size} bytes is too short for its header length")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES:
        raise MalformedInputError(f"safetensors header length {n} exceeds the limit of {MAX_HEADER_BYTES} bytes")
    if n > file_size - 8:
        raise MalformedInputError(f"safetensors header length {n} is larger than the file ({file_size} bytes)")
    raw = f.read(n)
    if len(raw) != n:
        raise MalformedInputError("safetensors header truncated")
    # Counted before parsing: parsed, a header's keys, lists and numbers take ~15-30× its bytes (a 38 MB header
    # of 600 000 tiny entries took 0.6 GB), so one with more of them than MAX_TENSORS entries can have is
    # refused while only the raw bytes are held. Strings are taken out first (a name may hold any character).
    if (count := structure_count(raw)) > MAX_STRUCTURE:
        raise MalformedInputError(f"safetensors header has {count} keys, list items and nestings, more than "
                                  f"{MAX_TENSORS} tensors (the limit) could have")
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as e:
        raise MalformedInputError(f"safetensors header is not valid UTF-8 JSON: {str(e)[:300]}") from None
    except RecursionError:  # '{"a":[[[[…' nested deeper than the decoder's stack: no header is
        raise MalformedInputError("safetensors header is not valid JSON for a header: it nests arrays or objects "
                                  "too deeply") from None
    if not isinstance(obj, dict):
        raise MalformedInputError("safetensors header is not a JSON object")
    meta = obj.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise MalformedInputError("safetensors __metadata__ must map strings to strings")
    if len(obj) > MAX_TENSORS:
        raise MalformedInputError(f"safetensors header lists {len(obj)} tensors (limit {MAX_TENSORS})")
    for key, value in meta.items():
        check_unicode(key, "safetensors __metadata__ key")
        check_unicode(value, f"safetensors __metadata__ value of {key!r}")
    for name in obj:
        check_unicode(name, "tensor name")
    data_start = 8 + n
    data_size = file_size - data_start
    entries = {name: _entry(name, v, data_size) for name, v in obj.items()}
    _check_overlaps(entries)
    return STHeader(n, data_start, data_size, entries, meta)
