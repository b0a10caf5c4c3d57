"""Safe, tensor-at-a-time readers for every input format.

``open_model(path)`` validates the container's metadata up front (headers, offsets, declared sizes)
and lists the tensors; ``load(name, device)`` reads ONE tensor into a fresh buffer, so peak memory
follows the largest tensor, not the file. No reader ever runs code from the file: PyTorch pickles
are loaded with ``weights_only=True`` and NumPy with ``allow_pickle=False``.

Caveats: a PyTorch zip checkpoint is memory-mapped (pages are read on touch; clean file pages may
stay resident but are reclaimable); a legacy (non-zip) PyTorch pickle cannot be mapped and is
loaded whole.
"""

from __future__ import annotations

import math
import os
import pickle
import pickletools
import re
import warnings
import zipfile
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, TypeVar

import numpy as np
import torch

from quantd.errors import (
    InputTooLargeError,
    MalformedInputError,
    UnsafeInputError,
    UnsupportedFormatError,
    check_unicode,
)

from .formats import QUANTIZABLE, ST_TO_TORCH, TORCH_TO_ST, Format, detect_format, dtype_name, torch_dtype
from .growing import GrowingFile
from .st_header import STHeader, read_header

DEFAULT_MAX_TENSOR_BYTES = 16 * 1024**3
_R = TypeVar("_R", bound="ModelReader")
# The NumPy dtypes a .npy/.npz tensor may have, by (kind, itemsize): every one torch holds as it is.
# Others (complex, float128/longdouble, strings, records, datetimes, ...) are refused by name.
_NP_TO_TORCH: dict[tuple[str, int], torch.dtype] = {
    ("f", 2): torch.float16, ("f", 4): torch.float32, ("f", 8): torch.float64,
    ("i", 1): torch.int8, ("i", 2): torch.int16, ("i", 4): torch.int32, ("i", 8): torch.int64,
    ("u", 1): torch.uint8, ("u", 2): torch.uint16, ("u", 4): torch.uint32, ("u", 8): torch.uint64,
    ("b", 1): torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch spelling without the prefix: float32, bfloat16, int64, ...
    nbytes: int


def sanitize_name(stem: str) -> str:
    """A tensor name from a filename stem: path parts dropped, odd characters replaced."""
    stem = re.sub(r"[^A-Za-z0-9_.\-]", "_", stem).strip(".") or "tensor"
    return stem


class ModelReader:
    """Base class: ``format``, ``tensors`` (in file order) and ``load(name, device)``."""

    format: Format

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tensors: list[TensorInfo] = []
        self._by_name: dict[str, TensorInfo] = {}

    def _add(self, info: TensorInfo) -> None:
        check_unicode(info.name, "tensor name")
        if info.name in self._by_name:
            raise MalformedInputError(f"tensor {info.name!r} appears twice", tensor=info.name)
        self._by_name[info.name] = info
        self.tensors.append(info)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in {self.path.name}") from None

    def load(self, name: str, device: str | torch.device) -> torch.Tensor:
        self.info(name)
        return self._load(name).to(device)

    def load_transient(self, name: str, device: str | torch.device) -> torch.Tensor:
        """As :meth:`load`, but the tensor may live in a buffer the reader reuses: valid only until the
        next ``load_transient`` (the one-tensor-at-a-time pipeline, spared a fresh allocation per tensor)."""
        return self.load(name, device)

    def non_finite(self, names: Iterable[str]) -> list[str]:
        """Those of ``names`` whose float tensors hold NaN or Inf, read one at a time."""
        return [n for n in names if torch_dtype(self.info(n).dtype) in QUANTIZABLE
                and not bool(torch.isfinite(self.load_transient(n, "cpu")).all())]

    def _load(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fill(f: IO[bytes] | GrowingFile, view: memoryview, *, what: str, tensor: str) -> None:
    """Fill ``view`` from ``f``; MalformedInputError when the file ends first."""
    n, got = len(view), 0
    while got < n:
        k = f.readinto(view[got:])  # type: ignore[attr-defined]
        if not k:
            raise MalformedInputError(f"tensor {tensor!r}: {what} truncated ({got} of {n} bytes)", tensor=tensor)
        got += k


def _read_exact(f: IO[bytes] | GrowingFile, n: int, *, what: str, tensor: str) -> bytearray:
    buf = bytearray(n)
    _fill(f, memoryview(buf), what=what, tensor=tensor)
    return buf


def _torch_from_bytes(buf: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if len(buf) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(shape)


class SafetensorsReader(ModelReader):
    """``source``: read from this open file instead of opening ``path`` (a :class:`~.growing.GrowingFile`
    while an upload streams in), with ``size_bound`` standing in for the file's size in the header's
    checks; offsets past the real end then fail as a truncated read."""

    format: Format = "safetensors"

    def __init__(self, path: Path, source: BinaryIO | GrowingFile | None = None, *,
                 size_bound: int | None = None) -> None:
        super().__init__(path)
        self._f = source if source is not None else path.open("rb")
        try:
            self.header: STHeader = read_header(self._f, size_bound)
        except BaseException:
            self._f.close()
            raise
        for e in self.header.entries.values():
            self._add(TensorInfo(e.name, e.shape, dtype_name(ST_TO_TORCH[e.dtype]), e.nbytes))
        self._scratch: torch.Tensor | None = None  # load_transient's buffer, grown to the largest tensor

    def _load(self, name: str) -> torch.Tensor:
        e = self.header.entries[name]
        self._f.seek(self.header.data_start + e.begin)
        buf = _read_exact(self._f, e.nbytes, what="data", tensor=name)
        return _torch_from_bytes(buf, ST_TO_TORCH[e.dtype], e.shape)

    def load_transient(self, name: str, device: str | torch.device) -> torch.Tensor:
        e = self.header.entries[self.info(name).name]
        if e.nbytes == 0:
            return self.load(name, device)
        if self._scratch is None or self._scratch.numel() < e.nbytes:
            self._scratch = None  # the old buffer goes before the larger one is allocated
            self._scratch = torch.empty(e.nbytes, dtype=torch.uint8)
        raw = self._scratch[:e.nbytes]
        self._f.seek(self.header.data_start + e.begin)
        _fill(self._f, memoryview(raw.numpy()).cast("B"), what="data", tensor=name)
        return raw.view(ST_TO_TORCH[e.dtype]).reshape(e.shape).to(device)

    def close(self) -> None:
        self._scratch = None
        self._f.close()


# Containers nested deeper than this in a checkpoint are refused (a state dict is a few levels deep).
MAX_NESTING = 64


def _flatten(obj: Any, prefix: str, out: dict[str, torch.Tensor], path: tuple[int, ...] = ()) -> None:
    """The tensors of nested dicts, lists and tuples under dotted names; ``path`` holds the ids of the
    containers above ``obj`` (the weights-only unpickler builds self-referencing ones)."""
    if isinstance(obj, torch.Tensor):
        name = prefix or "tensor"
        if name in out:
            raise MalformedInputError(f"tensor {name!r} appears twice after flattening nested dicts and lists",
                                      tensor=name)
        out[name] = obj
        return
    if not isinstance(obj, (Mapping, list, tuple)):
        return  # other leaves (ints, strings, hyper-parameters, ...) are not weights: skipped
    if id(obj) in path or len(path) >= MAX_NESTING:
        why = "contains itself" if id(obj) in path else f"nests containers more than {MAX_NESTING} deep"
        raise MalformedInputError(f"PyTorch checkpoint refused: {prefix or 'its top level'!r} {why}")
    inner = (*path, id(obj))
    # tensors in lists are named by index, as nn.ModuleList's are: layers.0, layers.1
    items = obj.items() if isinstance(obj, Mapping) else enumerate(obj)
    for k, v in items:
        _flatten(v, f"{prefix}.{k}" if prefix else str(k), out, inner)


def _check_stored(path: Path) -> None:
    """A PyTorch zip checkpoint is read in place (memory-mapped), which needs its entries stored as they are,
    as ``torch.save`` writes them; a compressed entry (an archive re-zipped by another tool, or one built to
    inflate to far more than its size) is refused, never inflated."""
    try:
        with zipfile.ZipFile(path) as zf:
            packed = next((zi for zi in zf.infolist() if zi.compress_type != zipfile.ZIP_STORED), None)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise MalformedInputError(f"corrupt PyTorch checkpoint (not a readable zip archive): {e}") from None
    if packed is not None:
        raise UnsupportedFormatError(
            f"PyTorch checkpoint with a compressed zip entry ({packed.filename!r}): quantd reads checkpoints "
            "as torch.save writes them, entries stored uncompressed; load and save it again with torch.save")


class PyTorchReader(ModelReader):
    format: Format = "pytorch"

    def __init__(self, path: Path, stem: str, max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES) -> None:
        super().__init__(path)
        with path.open("rb") as f:
            is_zip = f.read(4) == b"PK\x03\x04"
        if is_zip:
            _check_stored(path)
        try:
            with warnings.catch_warnings():  # the weights-only unpickler decides; its hint is noise
                warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
                obj = torch.load(path, weights_only=True, mmap=is_zip, map_location="cpu")
        except pickle.UnpicklingError as e:
            msg = str(e)
            why = _unpickler_reason(msg)
            if "Weights only load failed" in msg:
                # Either it needs code beyond plain tensors or it uses an opcode the weights-only
                # unpickler does not take (e.g. protocol 4 framing): refused either way, never run.
                raise UnsafeInputError(
                    f"PyTorch checkpoint refused: it cannot be loaded in weights-only mode (plain tensors "
                    f"and containers only; nothing was executed): {why or type(e).__name__}") from None
            raise MalformedInputError(f"corrupt PyTorch pickle: {why or msg[:300] or type(e).__name__}") from None
        except Exception as e:  # torch raises RuntimeError/EOFError/KeyError/... on corrupt archives
            raise MalformedInputError(f"corrupt PyTorch checkpoint ({type(e).__name__}): {_torch_reason(e)}"
                                      ) from None
        if isinstance(obj, Mapping) and len(obj) == 1:
            # {"state_dict": {...}} / {"model": {...}}: the usual checkpoint wrappers, unwrapped so names
            # match the model's own state dict. Deeper nesting is flattened with dots.
            (key, inner), = obj.items()
            if key in ("state_dict", "model") and isinstance(inner, Mapping):
                obj = inner
        flat: dict[str, torch.Tensor] = {}
        _flatten(obj, "" if not isinstance(obj, torch.Tensor) else stem, flat)
        self._tensors = flat
        for name, t in flat.items():
            if t.device.type != "cpu":  # map_location puts every real storage on the CPU: meta holds no data
                raise MalformedInputError(
                    f"tensor {name!r} is a {t.device.type}-device tensor: it has a shape but no data in the "
                    "checkpoint", tensor=name)
            if t.layout != torch.strided or t.dtype not in TORCH_TO_ST:
                raise UnsupportedFormatError(
                    f"tensor {name!r}: {t.layout} {t.dtype} tensors are not supported", tensor=name)
            nbytes = t.numel() * t.element_size()
            stored = t.untyped_storage().nbytes()
            if nbytes > max(max_tensor_bytes, stored):  # a view that repeats a few stored bytes (stride 0)
                raise InputTooLargeError(
                    f"tensor {name!r}: shape {list(t.shape)} of {dtype_name(t.dtype)} is {nbytes} bytes once "
                    f"materialized, from {stored} stored bytes (limit {max_tensor_bytes})", tensor=name)
            self._add(TensorInfo(name, tuple(t.shape), dtype_name(t.dtype), nbytes))

    def _load(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def close(self) -> None:
        self._tensors = {}


@dataclass(frozen=True)
class _NpyHeader:
    shape: tuple[int, ...]
    fortran: bool
    dtype: np.dtype[Any]
    header_end: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _read_npy_header(f: IO[bytes], name: str) -> _NpyHeader:
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"unsupported .npy format version {version}")
    except (ValueError, OSError, EOFError, SyntaxError, RecursionError, MemoryError) as e:
        why = str(e)[:300] or type(e).__name__
        raise MalformedInputError(f"tensor {name!r}: bad .npy header: {why}", tensor=name) from None
    if dtype.hasobject:
        raise UnsafeInputError(f"tensor {name!r}: object arrays need pickle and are refused", tensor=name)
    if (dtype.kind, dtype.itemsize) not in _NP_TO_TORCH or dtype.fields is not None or dtype.subdtype is not None:
        raise UnsupportedFormatError(
            f"tensor {name!r}: NumPy dtype {dtype} is not supported (float16/32/64, int8-64, uint8-64 and bool "
            "are)", tensor=name)
    if any(s < 0 for s in shape):
        raise MalformedInputError(f"tensor {name!r}: bad .npy header: shape {list(shape)} has a negative "
                                  "dimension", tensor=name)
    return _NpyHeader(tuple(int(s) for s in shape), bool(fortran), dtype, f.tell())


def _torch_from_npy_bytes(buf: bytearray, h: _NpyHeader) -> torch.Tensor:
    native = h.dtype.newbyteorder("=")
    arr = np.frombuffer(buf, dtype=h.dtype).reshape(h.shape, order="F" if h.fortran else "C")
    if not arr.flags.c_contiguous or h.dtype != native:
        arr = np.ascontiguousarray(arr.astype(native))
    if arr.size == 0:
        return torch.from_numpy(np.empty(h.shape, dtype=native))
    return torch.from_numpy(arr)


def _torch_dtype_of(dtype: np.dtype[Any]) -> torch.dtype:
    return _NP_TO_TORCH[dtype.kind, dtype.itemsize]  # checked by _read_npy_header


class NpyReader(ModelReader):
    format: Format = "npy"

    def __init__(self, path: Path, stem: str) -> None:
        super().__init__(path)
        self._name = sanitize_name(stem)
        size = path.stat().st_size
        with path.open("rb") as f:
            self._h = _read_npy_header(f, self._name)
        if size != self._h.header_end + self._h.nbytes:
            raise MalformedInputError(
                f"tensor {self._name!r}: shape {list(self._h.shape)} of {self._h.dtype} needs "
                f"{self._h.nbytes} data bytes but the file holds {size - self._h.header_end}", tensor=self._name)
        self._add(TensorInfo(self._name, self._h.shape, dtype_name(_torch_dtype_of(self._h.dtype)), self._h.nbytes))

    def _load(self, name: str) -> torch.Tensor:
        with self.path.open("rb") as f:
            f.seek(self._h.header_end)
            return _torch_from_npy_bytes(_read_exact(f, self._h.nbytes, what="data", tensor=name), self._h)


class NpzReader(ModelReader):
    """A zip of ``.npy`` members. Every member's declared size is checked before it is inflated:
    a decompression bomb fails on its header, and reads never go past the declared size.
    ``max_tensor_bytes`` bounds each member, ``max_total_bytes`` (if given) all of them together."""

    format: Format = "npz"

    def __init__(self, path: Path, max_tensor_bytes: int, max_total_bytes: int | None = None) -> None:
        super().__init__(path)
        self._max_total, self._left = max_total_bytes, max_total_bytes
        try:
            self._zf = zipfile.ZipFile(path)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            raise MalformedInputError(f"corrupt .npz archive: {e}") from None
        self._members: dict[str, tuple[zipfile.ZipInfo, _NpyHeader]] = {}
        try:
            for zi in self._zf.infolist():
                self._scan(zi, max_tensor_bytes)
        except BaseException:
            self._zf.close()
            raise

    def _scan(self, zi: zipfile.ZipInfo, limit: int) -> None:
        if not zi.filename.endswith(".npy"):
            raise MalformedInputError(f".npz member {zi.filename!r} is not a .npy array")
        name = zi.filename.removesuffix(".npy")
        try:
            with self._zf.open(zi) as f:
                h = _read_npy_header(f, name)
        except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError) as e:
            raise MalformedInputError(f"tensor {name!r}: corrupt .npz member: {e}", tensor=name) from None
        room = limit if self._left is None else min(limit, self._left)
        if h.nbytes > room:
            if room == limit:
                why = f"limit {limit}"
            elif self._left == self._max_total:
                why = f"the archive may unpack to {self._max_total} bytes"
            else:
                why = (f"the archive may unpack to {self._max_total} bytes in all, {self._left} after the "
                       "members before it")
            raise InputTooLargeError(
                f"tensor {name!r}: shape {list(h.shape)} of {h.dtype} declares {h.nbytes} bytes ({why}); "
                "refused before inflating it", tensor=name)
        if self._left is not None:
            self._left -= h.nbytes
        if zi.file_size != h.header_end + h.nbytes:
            raise MalformedInputError(
                f"tensor {name!r}: the archive declares {zi.file_size} uncompressed bytes but the .npy "
                f"header implies {h.header_end + h.nbytes}", tensor=name)
        self._members[name] = (zi, h)
        self._add(TensorInfo(name, h.shape, dtype_name(_torch_dtype_of(h.dtype)), h.nbytes))

    def _load(self, name: str) -> torch.Tensor:
        zi, h = self._members[name]
        try:
            with self._zf.open(zi) as f:
                f.read(h.header_end)
                buf = _read_exact(f, h.nbytes, what="member data", tensor=name)
                if f.read(1):
                    raise MalformedInputError(f"tensor {name!r}: member longer than declared", tensor=name)
        except (zipfile.BadZipFile, zlib.error, EOFError) as e:
            raise MalformedInputError(f"tensor {name!r}: corrupt .npz member: {e}", tensor=name) from None
        return _torch_from_npy_bytes(buf, h)

    def close(self) -> None:
        self._zf.close()


def open_model(path: str | os.PathLike[str], filename: str | None = None, *,
               max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES, max_total_bytes: int | None = None) -> ModelReader:
    """Open ``path`` (format detected from content) for tensor-at-a-time reading.

    ``filename`` is the upload's original name (a ``.npy`` tensor is named by its stem).
    ``max_tensor_bytes`` bounds what a tensor may declare beyond the bytes the file stores for it (an npz
    member, a PyTorch view repeating its storage). ``max_total_bytes`` (a request's upload limit) bounds
    the tensors' bytes once loaded, all together: an npz is refused from its members' headers, before
    any is inflated (InputTooLargeError, 413).
    """
    p = Path(path)
    stem = Path(filename or p.name).stem
    fmt = detect_format(p)
    reader: ModelReader
    if fmt == "safetensors":
        reader = SafetensorsReader(p)
    elif fmt == "pytorch":
        reader = PyTorchReader(p, sanitize_name(stem), max_tensor_bytes)
    elif fmt == "npy":
        reader = NpyReader(p, stem)
    elif fmt == "gguf":
        from .gguf_file import GGUFReader  # the GGUF module builds on this one

        reader = GGUFReader(p)
    else:
        reader = NpzReader(p, max_tensor_bytes, max_total_bytes)
    if max_total_bytes is not None:
        total = sum(t.nbytes for t in reader.tensors)
        if total > max_total_bytes:
            biggest = max(reader.tensors, key=lambda t: t.nbytes)
            reader.close()
            raise InputTooLargeError(
                f"the file's tensors hold {total} bytes once loaded (the largest: {biggest.name!r}, "
                f"{biggest.nbytes} bytes), more than the limit of {max_total_bytes} bytes", tensor=biggest.name)
    return reader


_TORCH_LOAD_BOILERPLATE = ("Weights only load failed", "Check the documentation", "Please file an issue",
                           "Re-running `torch.load`", "In PyTorch 2.6")


def _unpickler_reason(msg: str) -> str:
    """What torch's weights-only unpickler refused (``Trying to load unsupported GLOBAL posix.system …``),
    without its advice to load the file with ``weights_only=False``, which quantd never does. The reason
    may follow on a line of its own (``Unsupported operand 149``: named as the pickle opcode it is)."""
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    for i, ln in enumerate(lines):
        if "WeightsUnpickler error:" in ln:
            why = ln.split("WeightsUnpickler error:", 1)[1].strip()
            if not why and i + 1 < len(lines) and not lines[i + 1].startswith(_TORCH_LOAD_BOILERPLATE):
                why = lines[i + 1]
            return _name_opcode(why)[:300]
    return next((ln[:300] for ln in lines if not ln.startswith(_TORCH_LOAD_BOILERPLATE)), "")


def _name_opcode(why: str) -> str:
    m = re.fullmatch(r"Unsupported operand (\d{1,3})", why)
    if m is None:
        return why
    code = int(m.group(1))
    op = next((op.name for op in pickletools.opcodes if op.code == chr(code)), "not a pickle opcode")
    return f"unsupported pickle opcode {code:#04x} ({op})"


# torch's C++ checks whose printf-style arguments come out appended to the unformatted text, e.g.
# ``storage has wrong byte size: expected %ld got %ld163844294967296``: the numbers cannot be told apart.
_TORCH_UNFORMATTED = {
    "storage has wrong byte size": "a storage's byte size in the data section differs from the size its "
                                   "tensor's pickle declares (truncated or lying header)",
}


def _torch_reason(e: BaseException) -> str:
    """A torch error's message for a detail: never empty, unformatted printf arguments cut off."""
    msg = str(e).strip()
    if "%" in msg:
        for start, clean in _TORCH_UNFORMATTED.items():
            if msg.startswith(start):
                return clean
        msg = re.split(r":?\s*(?:expected\s*)?%l{0,2}[dius]", msg, maxsplit=1)[0].strip()
    return msg[:300] or f"{type(e).__name__} with no message"
