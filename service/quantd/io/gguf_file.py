"""GGUF files (llama.cpp): a bounded, validating parser, a :class:`ModelReader` over its tensors, and a
streaming writer.

Our own small parser rather than gguf-py's ``GGUFReader``: that one memory-maps the file and builds NumPy
views of every field and tensor with the counts and offsets as the file states them, so a lying header
costs memory or raises deep inside NumPy; here every count, length and offset is checked against the
bytes the file actually has before anything is allocated, and each metadata pair is kept as its raw bytes
so that the output repeats it exactly. The writer streams: header, metadata and tensor table first (every
size is known from the plan), then each tensor as it is quantized.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import numpy as np
import torch

from quantd.errors import ConfigError, MalformedInputError, UnsupportedFormatError

from .readers import ModelReader, TensorInfo

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_STRING = 1 << 26  # one metadata string (a chat template, a merges line): 64 MiB at most
MAX_ALIGNMENT = 1 << 16

# Value types of metadata (gguf_type).
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_SCALARS: dict[int, str] = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
                            U64: "<Q", I64: "<q", F64: "<d"}
_SIZES = {k: struct.calcsize(v) for k, v in _SCALARS.items()}
_TYPE_NAMES = {U8: "UINT8", I8: "INT8", U16: "UINT16", I16: "INT16", U32: "UINT32", I32: "INT32", F32: "FLOAT32",
               BOOL: "BOOL", STRING: "STRING", ARRAY: "ARRAY", U64: "UINT64", I64: "INT64", F64: "FLOAT64"}

# Float tensor types quantd reads as tensors (everything else known to ggml passes through as bytes).
FLOAT_TYPES: dict[int, torch.dtype] = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}
TYPE_OF_DTYPE: dict[torch.dtype, int] = {v: k for k, v in FLOAT_TYPES.items()}
# Element types read as tensors too and passed through as they are (ggml's I8 … I64 and F64).
PLAIN_TYPES: dict[int, torch.dtype] = {24: torch.int8, 25: torch.int16, 26: torch.int32, 27: torch.int64,
                                       28: torch.float64}


@functools.cache
def block_sizes() -> dict[int, tuple[int, int]]:
    """Every type ggml defines: ``type id → (elements per block, bytes per block)``. The ``gguf`` package
    is imported here, on first GGUF work, because its import costs every other job tens of milliseconds."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(t): v for t, v in GGML_QUANT_SIZES.items()}


def type_name(type_id: int) -> str:
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


def tensor_nbytes(type_id: int, ne: Sequence[int]) -> int:
    block, size = block_sizes()[type_id]
    return math.prod(ne) // block * size


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor table: ``ne`` in ggml's order (``ne[0]`` is the row length), ``offset``
    relative to the data section."""

    name: str
    ne: tuple[int, ...]
    type_id: int
    offset: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """torch order: ``ne`` reversed."""
        return tuple(reversed(self.ne))


@dataclass(frozen=True)
class KeyValue:
    key: str
    value_type: int
    value: Any  # scalars and strings; arrays as ``(element_type, count)``
    raw: bytes  # the whole pair as stored (key, type, value)

    @property
    def first(self) -> Any:
        """A scalar's value, or the first element of a numeric array (per-layer hyper-parameters, such as
        ``{arch}.attention.head_count`` of deci or openelm, whose layer 0 llama.cpp reads as ``n_head()``);
        None for an empty array or one of strings."""
        if self.value_type != ARRAY:
            return self.value
        etype, count = self.value
        if etype not in _SCALARS or not count:
            return None
        (key_bytes,) = struct.unpack_from("<Q", self.raw)  # as stored: the decoded key may differ in length
        return struct.unpack_from(_SCALARS[etype], self.raw, 8 + key_bytes + 4 + 4 + 8)[0]


class _Cursor:
    """Sequential reads from a file that never ask for more than it has."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f = f
        self.size = size
        self.pos = 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.size - self.pos:
            raise MalformedInputError(f"GGUF {what} at byte {self.pos} needs {n} bytes; the file has "
                                      f"{self.size - self.pos} left (truncated or lying header)")
        data = self.f.read(n)
        if len(data) != n:
            raise MalformedInputError(f"GGUF file shorter than its size while reading {what}")
        self.pos += n
        return data

    def unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> bytes:
        n = self.unpack("<Q", what)
        if n > MAX_STRING:
            raise MalformedInputError(f"GGUF {what}: string of {n} bytes (at most {MAX_STRING})")
        return self.take(n, what)


def _value(c: _Cursor, vtype: int, key: str, depth: int = 0) -> Any:
    if vtype in _SCALARS:
        return c.unpack(_SCALARS[vtype], f"value of {key!r}")
    if vtype == STRING:
        return c.string(f"value of {key!r}").decode("utf-8", errors="replace")
    if vtype == ARRAY:
        if depth:
            raise MalformedInputError(f"GGUF key {key!r}: nested arrays are not supported")
        etype = c.unpack("<I", f"array type of {key!r}")
        count = c.unpack("<Q", f"array length of {key!r}")
        if etype in _SIZES:
            c.take(count * _SIZES[etype], f"array {key!r} of {count} values")
        elif etype == STRING:
            if count * 8 > c.size - c.pos:
                raise MalformedInputError(f"GGUF array {key!r} claims {count} strings; the file cannot hold them")
            for _ in range(count):
                c.string(f"array {key!r}")
        elif etype == ARRAY:  # an array of arrays: no llama.cpp metadata key has one
            raise MalformedInputError(f"GGUF array {key!r} holds arrays: nested arrays are not supported")
        else:
            raise MalformedInputError(f"GGUF array {key!r} has an unknown element type {etype}")
        return (etype, count)
    raise MalformedInputError(f"GGUF key {key!r} has an unknown value type {vtype}")


def _tensor_name(raw: bytes, index: int) -> str:
    """A tensor table name: non-empty UTF-8 (a name decoded with replacement characters would rename the
    tensor in the output)."""
    if not raw:
        raise MalformedInputError(f"GGUF tensor {index} (0-based, in the tensor table) has an empty name")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MalformedInputError(f"GGUF tensor {index} (0-based, in the tensor table): its name {raw[:64]!r} "
                                  f"is not valid UTF-8 ({e.reason} at byte {e.start})") from None


class GGUFFile:
    """The parsed header of a GGUF file: version, metadata (in order), tensor table (in order), alignment
    and where the data section starts. Raises MalformedInputError (422) for anything the bytes do not
    support: counts the file cannot hold, unknown types, offsets outside the data or overlapping, tensors
    that do not fit."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            c = _Cursor(f, size)
            if c.take(4, "magic") != MAGIC:
                raise UnsupportedFormatError("not a GGUF file (no GGUF magic)")
            self.version = c.unpack("<I", "version")
            if self.version not in (2, 3):
                raise MalformedInputError(f"GGUF version {self.version} is not supported (2 and 3 are)")
            n_tensors = c.unpack("<Q", "tensor count")
            n_kv = c.unpack("<Q", "metadata count")
            # each pair holds at least a key length, a type and one byte; each tensor at least 4 + 8 + 4 + 8 bytes
            if n_kv * 13 > size - c.pos:
                raise MalformedInputError(f"GGUF header claims {n_kv} metadata pairs; the file cannot hold them")
            if n_tensors * 24 > size - c.pos:
                raise MalformedInputError(f"GGUF header claims {n_tensors} tensors; the file cannot hold them")
            self.metadata: list[KeyValue] = []
            seen: set[str] = set()
            for _ in range(n_kv):
                start = c.pos
                key = c.string("metadata key").decode("utf-8", errors="replace")
                if key in seen:
                    raise MalformedInputError(f"GGUF metadata key {key!r} appears twice")
                seen.add(key)
                vtype = c.unpack("<I", f"type of {key!r}")
                value = _value(c, vtype, key)
                f.seek(start)
                raw = f.read(c.pos - start)
                self.metadata.append(KeyValue(key, vtype, value, raw))
            self.alignment = self._alignment()
            self.tensors: list[GGUFTensor] = []
            names: set[str] = set()
            for index in range(n_tensors):
                name = _tensor_name(c.string(f"name of tensor {index}"), index)
                if name in names:
                    raise MalformedInputError(f"GGUF tensor {name!r} appears twice")
                names.add(name)
                n_dims = c.unpack("<I", f"dims of {name!r}")
                if not 1 <= n_dims <= MAX_DIMS:
                    raise MalformedInputError(f"GGUF tensor {name!r} has {n_dims} dims (1 to {MAX_DIMS})")
                ne = tuple(c.unpack("<Q", f"shape of {name!r}") for _ in range(n_dims))
                type_id = c.unpack("<I", f"type of {name!r}")
                offset = c.unpack("<Q", f"offset of {name!r}")
                if type_id not in block_sizes():
                    raise MalformedInputError(f"GGUF tensor {name!r} has an unknown ggml type {type_id}")
                if any(n == 0 for n in ne) or math.prod(ne) > 1 << 50:
                    raise MalformedInputError(f"GGUF tensor {name!r} has an impossible shape {list(ne)}")
                block = block_sizes()[type_id][0]
                if ne[0] % block:
                    raise MalformedInputError(f"GGUF tensor {name!r}: row length {ne[0]} is not a multiple of "
                                              f"{type_name(type_id)}'s block of {block}")
                if offset % self.alignment:
                    raise MalformedInputError(f"GGUF tensor {name!r}: offset {offset} is not aligned to "
                                              f"{self.alignment}")
                self.tensors.append(GGUFTensor(name, ne, type_id, offset, tensor_nbytes(type_id, ne)))
            self.data_start = -(-c.pos // self.alignment) * self.alignment
        data_size = size - self.data_start
        end = 0
        for t in sorted(self.tensors, key=lambda t: t.offset):
            if t.offset < end:
                raise MalformedInputError(f"GGUF tensor {t.name!r} overlaps the tensor before it")
            end = t.offset + t.nbytes
            if end > data_size:
                raise MalformedInputError(f"GGUF tensor {t.name!r} ends at byte {self.data_start + end}; the file "
                                          f"has {size} (truncated or lying offsets)")
        self.size = size

    def _alignment(self) -> int:
        """``general.alignment``, as llama.cpp and gguf-py take it: a UINT32 (llama.cpp asserts the type; the
        output repeats the pair as stored) that is a power of two, here up to MAX_ALIGNMENT."""
        kv = next((kv for kv in self.metadata if kv.key == "general.alignment"), None)
        if kv is None:
            return DEFAULT_ALIGNMENT
        if kv.value_type != U32:
            raise MalformedInputError(f"GGUF general.alignment is stored as {_TYPE_NAMES.get(kv.value_type)}; "
                                      "llama.cpp takes a UINT32 (a power of two)")
        value: int = kv.value
        if not 0 < value <= MAX_ALIGNMENT or value & (value - 1):
            raise MalformedInputError(f"GGUF general.alignment {value} is not a power of two from 1 to "
                                      f"{MAX_ALIGNMENT}")
        return value

    def get(self, key: str, default: Any = None) -> Any:
        for kv in self.metadata:
            if kv.key == key:
                return kv.value
        return default

    @property
    def architecture(self) -> str:
        arch = self.get("general.architecture")
        return arch if isinstance(arch, str) else ""


class GGUFReader(ModelReader):
    """A GGUF file as a :class:`ModelReader`: F32/F16/BF16 tensors (and the plain I8 … I64, F64 ones) load as
    torch tensors of their torch shape (``ne`` reversed). A model whose tensors are already quantized (ggml
    block types) is refused, as ``llama-quantize`` refuses to requantize: its blocks are not the weights, and
    quantizing them again compounds two roundings."""

    format = "gguf"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.file = GGUFFile(path)
        self._entries = {t.name: t for t in self.file.tensors}
        for t in self.file.tensors:
            dtype = FLOAT_TYPES.get(t.type_id) or PLAIN_TYPES.get(t.type_id)
            if dtype is None:
                raise ConfigError(f"GGUF tensor {t.name!r} is already quantized ({type_name(t.type_id)}): quantd "
                                  "quantizes GGUF models of F32, F16 and BF16 tensors (convert the original model "
                                  "with llama.cpp's convert_hf_to_gguf.py --outtype f16)", field="file")
            self._add(TensorInfo(t.name, t.shape, str(dtype).removeprefix("torch."), t.nbytes))
        self._f: BinaryIO = open(path, "rb")  # noqa: SIM115 - held for the reader's life, closed by close()

    def entry(self, name: str) -> GGUFTensor:
        return self._entries[name]

    def raw(self, name: str) -> bytearray:
        t = self._entries[name]
        self._f.seek(self.file.data_start + t.offset)
        buf = bytearray(t.nbytes)
        if self._f.readinto(buf) != t.nbytes:  # type: ignore[attr-defined]
            raise MalformedInputError(f"GGUF tensor {name!r} is truncated")
        return buf

    def _load(self, name: str) -> torch.Tensor:
        t = self._entries[name]
        buf = self.raw(name)
        dtype = FLOAT_TYPES.get(t.type_id) or PLAIN_TYPES[t.type_id]
        return torch.frombuffer(buf, dtype=dtype).reshape(t.shape)

    def close(self) -> None:
        self._f.close()


def _kv_bytes(key: str, vtype: int, value: Any) -> bytes:
    k = key.encode()
    head = struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype)
    if vtype == STRING:
        v = str(value).encode()
        return head + struct.pack("<Q", len(v)) + v
    return head + struct.pack(_SCALARS[vtype], value)


@dataclass(frozen=True)
class OutTensor:
    name: str
    ne: tuple[int, ...]
    type_id: int

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.type_id, self.ne)


class GGUFWriter:
    """Streams a GGUF file: ``metadata`` (raw pairs, in order; ``overrides`` replace or append scalar and
    string keys), the tensor table of ``tensors``, then each tensor's bytes through :meth:`write`, in table
    order. Written under a temporary name, renamed by :meth:`finish`."""

    def __init__(self, dst: str | os.PathLike[str], metadata: Sequence[KeyValue], tensors: Sequence[OutTensor], *,
                 alignment: int = DEFAULT_ALIGNMENT, overrides: Mapping[str, tuple[int, Any]] | None = None) -> None:
        self.dst = Path(dst)
        self.tmp = self.dst.with_name(self.dst.name + ".partial")
        self.tensors = list(tensors)
        self.alignment = alignment
        pairs = [kv.raw if kv.key not in (overrides or {}) else _kv_bytes(kv.key, *overrides[kv.key])  # type: ignore[index]
                 for kv in metadata]
        have = {kv.key for kv in metadata}
        pairs += [_kv_bytes(k, *v) for k, v in (overrides or {}).items() if k not in have]
        table = bytearray()
        self._offsets: list[int] = []
        off = 0
        for t in self.tensors:
            n = t.name.encode()
            table += struct.pack("<Q", len(n)) + n + struct.pack("<I", len(t.ne))
            table += struct.pack(f"<{len(t.ne)}Q", *t.ne) + struct.pack("<IQ", t.type_id, off)
            self._offsets.append(off)
            off += -(-t.nbytes // alignment) * alignment
        head = MAGIC + struct.pack("<IQQ", 3, len(self.tensors), len(pairs)) + b"".join(pairs) + bytes(table)
        self._f: BinaryIO = open(self.tmp, "wb")  # noqa: SIM115 - closed by finish() or abort()
        self._f.write(head + bytes(-len(head) % alignment))
        self._data_start = self._f.tell()
        self._next = 0

    @property
    def total_bytes(self) -> int:
        return self._f.tell()

    def write(self, name: str, data: torch.Tensor | bytes | bytearray | np.ndarray) -> None:
        t = self.tensors[self._next]
        if name != t.name:
            raise RuntimeError(f"GGUF tensor {name!r} written out of order (expected {t.name!r})")
        if isinstance(data, torch.Tensor):
            data = data.detach().cpu().contiguous().view(torch.uint8).numpy()
        mv = memoryview(data).cast("B")  # type: ignore[arg-type]
        if mv.nbytes != t.nbytes:
            raise RuntimeError(f"GGUF tensor {name!r}: {mv.nbytes} bytes, the table says {t.nbytes}")
        self._f.seek(self._data_start + self._offsets[self._next])
        self._f.write(mv)
        self._next += 1

    def finish(self) -> int:
        if self._next != len(self.tensors):
            raise RuntimeError(f"GGUF writer finished after {self._next} of {len(self.tensors)} tensors")
        end = self._f.tell()
        self._f.write(bytes(-end % self.alignment))
        self._f.flush()
        os.fsync(self._f.fileno())
        size = self._f.tell()
        self._f.close()
        os.replace(self.tmp, self.dst)
        return size

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> GGUFWriter:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if et is not None:
            self.abort()
