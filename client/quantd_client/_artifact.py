"""Read and dequantize a quantd artifact (CONTRACT §5) with NumPy alone: no torch, no safetensors.

The safetensors container is parsed here (8-byte little-endian header length, JSON header, data);
bf16 is widened by a shift, fp8 decoded through 256-entry tables built from the bit formulas,
packed codes unpacked from their little-endian bitstream with ``np.unpackbits``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ._dtypes import DTYPES, NF4_CODEBOOK

__all__ = ["E4M3_TABLE", "E5M2_TABLE", "ArtifactError", "ArtifactFile", "bf16_to_float32", "read_artifact",
           "unpack_bits"]

MAX_HEADER_BYTES = 100 * 1024 * 1024
_UNPACK_CHUNK = 1 << 22

# safetensors dtype -> how its bytes are viewed in NumPy (bf16/fp8 as their raw bit patterns).
_ST_NUMPY: dict[str, str] = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "F8_E4M3": "u1", "F8_E5M2": "u1",
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2",
    "U8": "u1", "BOOL": "?",
}


class ArtifactError(ValueError):
    """The bytes are not a well-formed quantd artifact."""


def safetensors_header(entries: Iterable[tuple[str, str, Sequence[int], int]]) -> bytes:
    """The start of a safetensors file whose tensors ``(name, dtype, shape, nbytes)`` follow in that order:
    the 8-byte little-endian length and the JSON header, padded with spaces so that the data starts 8-aligned."""
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _fp8_table(exp_bits: int, man_bits: int, bias: int, *, finite_only: bool) -> npt.NDArray[np.float32]:
    """float32 value of every 8-bit pattern ``s | e (exp_bits) | m (man_bits)``.

    normal: ``(−1)^s · (1 + m/2^M) · 2^(e − bias)``; subnormal (e = 0): ``(−1)^s · m/2^M · 2^(1 − bias)``.
    ``finite_only`` (e4m3fn): no infinities, only all-ones exponent AND mantissa is NaN;
    otherwise (e5m2, IEEE-like): all-ones exponent is ±inf (m = 0) or NaN.
    """
    b = np.arange(256, dtype=np.int64)
    sign = np.where(b >> 7, -1.0, 1.0)
    e = (b >> man_bits) & ((1 << exp_bits) - 1)
    m = (b & ((1 << man_bits) - 1)).astype(np.float64) / (1 << man_bits)
    v = sign * np.where(e == 0, m * 2.0 ** (1 - bias), (1.0 + m) * np.exp2((e - bias).astype(np.float64)))
    top = (1 << exp_bits) - 1
    frac = b & ((1 << man_bits) - 1)
    if finite_only:
        v[(e == top) & (frac == (1 << man_bits) - 1)] = np.nan
    else:
        inf = (e == top) & (frac == 0)
        v[inf] = sign[inf] * np.inf
        v[(e == top) & (frac != 0)] = np.nan
    return v.astype(np.float32)


E4M3_TABLE = _fp8_table(4, 3, 7, finite_only=True)
E5M2_TABLE = _fp8_table(5, 2, 15, finite_only=False)
_NF4 = np.asarray(NF4_CODEBOOK, dtype=np.float32)


def bf16_to_float32(bits: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """bfloat16 bit patterns (uint16) -> float32: bf16 is the upper half of a float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def unpack_bits(packed: npt.NDArray[np.uint8], bits: int, numel: int) -> npt.NDArray[np.uint8]:
    """Inverse of the CONTRACT §5 packing: value j sits at stream bits [j·b, j·b + b), stream bit i
    in byte i // 8 at bit i % 8 (so int4 puts the first value in the low nibble)."""
    if packed.size * 8 < numel * bits:
        raise ArtifactError(f"packed stream of {packed.size} bytes is too short for {numel} {bits}-bit codes")
    if 8 % bits == 0:  # 1, 2, 4 bits: whole codes per byte, shifted out without a bit matrix
        per = 8 // bits
        shifts = np.arange(0, 8, bits, dtype=np.uint8)
        need = -(-numel // per)
        fields = (packed[:need, None] >> shifts) & np.uint8((1 << bits) - 1)
        return np.ascontiguousarray(fields.reshape(-1)[:numel])
    # Any width ≤ 8 spans at most two bytes: read them as one little-endian uint16 and shift.
    padded = np.concatenate([packed, np.zeros(1, np.uint8)]).astype(np.uint16)
    out = np.empty(numel, dtype=np.uint8)
    mask = np.uint16((1 << bits) - 1)
    for lo in range(0, numel, _UNPACK_CHUNK):  # chunks bound the int64 index temporaries
        start = np.arange(lo, min(lo + _UNPACK_CHUNK, numel), dtype=np.int64) * bits
        byte = start >> 3
        pair = padded[byte] | (padded[byte + 1] << np.uint16(8))
        out[lo:lo + start.size] = (pair >> (start & 7).astype(np.uint16)) & mask
    return out


@dataclass(frozen=True)
class _Entry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _parse_header(buf: npt.NDArray[np.uint8]) -> tuple[dict[str, _Entry], dict[str, str], int]:
    if buf.size < 8:
        raise ArtifactError("too short for a safetensors header")
    n = int(buf[:8].view("<u8")[0])
    if n > MAX_HEADER_BYTES or n > buf.size - 8:
        raise ArtifactError(f"header length {n} is out of range for {buf.size} bytes")
    try:
        header = json.loads(buf[8:8 + n].tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ArtifactError(f"header is not UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise ArtifactError("header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    data_size = buf.size - 8 - n
    entries: dict[str, _Entry] = {}
    for name, raw in header.items():
        try:
            dtype, shape, (begin, end) = raw["dtype"], tuple(int(s) for s in raw["shape"]), raw["data_offsets"]
            itemsize = np.dtype(_ST_NUMPY[dtype]).itemsize
        except (KeyError, TypeError, ValueError):
            raise ArtifactError(f"tensor {name!r}: malformed header entry {raw!r}") from None
        if not (0 <= begin <= end <= data_size) or end - begin != math.prod(shape) * itemsize:
            raise ArtifactError(f"tensor {name!r}: data_offsets [{begin}, {end}] do not fit {dtype} {list(shape)}")
        entries[name] = _Entry(dtype, shape, 8 + n + begin, 8 + n + end)
    return entries, meta, n


class ArtifactFile:
    """A parsed artifact. ``metadata`` is the decoded ``__metadata__["quantd"]`` object."""

    def __init__(self, buf: npt.NDArray[np.uint8]) -> None:
        self._buf = buf
        self._entries, self.raw_metadata, _ = _parse_header(buf)
        try:
            meta = json.loads(self.raw_metadata["quantd"])
        except (KeyError, ValueError):
            raise ArtifactError("not a quantd artifact: no JSON __metadata__['quantd']") from None
        if not isinstance(meta, dict) or meta.get("format_version") != 1:
            raise ArtifactError("unsupported quantd artifact format_version")
        self.metadata: dict[str, Any] = meta
        self.tensor_names: list[str] = list(self._entries)
        self.quantized: list[str] = list(meta.get("tensors", {}))
        owned = {f"{n}.{s}" for n in self.quantized for s in ("qdata", "scale", "zero_point", "g_idx", "channel_scale")}
        self.passthrough: list[str] = [n for n in self.tensor_names if n not in owned]

    @property
    def summary(self) -> dict[str, Any] | None:
        s = self.metadata.get("summary")
        return s if isinstance(s, dict) else None

    def raw(self, name: str) -> npt.NDArray[Any]:
        """The stored tensor ``name`` as is (bf16 as uint16 and fp8 as uint8 bit patterns)."""
        try:
            e = self._entries[name]
        except KeyError:
            raise KeyError(f"no tensor {name!r} in the artifact") from None
        return self._buf[e.begin:e.end].view(_ST_NUMPY[e.dtype]).reshape(e.shape)

    def tensor(self, name: str) -> npt.NDArray[Any]:
        """The stored tensor ``name`` with bf16/fp8 decoded to float32; other dtypes as stored."""
        arr, dtype = self.raw(name), self._entries[name].dtype
        if dtype == "BF16":
            return bf16_to_float32(arr)
        if dtype in ("F8_E4M3", "F8_E5M2"):
            table = E4M3_TABLE if dtype == "F8_E4M3" else E5M2_TABLE
            return np.take(table, arr)
        return arr

    def _values(self, name: str, m: Mapping[str, Any]) -> npt.NDArray[Any]:
        """Codes (int32, zero point not yet removed) or float32 values, in the original shape."""
        info = DTYPES[m["dtype"]]
        shape = tuple(int(s) for s in m["shape"])
        q = self.raw(f"{name}.qdata")
        if info.kind in ("float", "fp8"):
            return self.tensor(f"{name}.qdata").astype(np.float32).reshape(shape)
        if info.packed:
            offsets = unpack_bits(q, info.bits, math.prod(shape)).reshape(shape)
            if info.kind == "nf4":
                return _NF4[offsets]
            return offsets.astype(np.int32) + info.qmin
        return q.astype(np.int32).reshape(shape)

    def _dequantize_one(self, name: str) -> npt.NDArray[np.float32]:
        m = self.metadata["tensors"][name]
        v = self._values(name, m)
        if DTYPES[m["dtype"]].kind == "float":
            return v.astype(np.float32)
        scale = self.tensor(f"{name}.scale").astype(np.float32)
        zp: npt.NDArray[Any] | None = None
        if f"{name}.zero_point" in self._entries:  # CONTRACT §10: "float" zero points are stored in scale_dtype
            zp = (self.tensor(f"{name}.zero_point").astype(np.float32) if m.get("zero_point_domain") == "float"
                  else self.raw(f"{name}.zero_point").astype(np.int32))
        g_idx = self.raw(f"{name}.g_idx") if f"{name}.g_idx" in self._entries else None
        cs = self.raw(f"{name}.channel_scale") if f"{name}.channel_scale" in self._entries else None
        if g_idx is not None or cs is not None:
            return _apply_columns(v, scale, zp, g_idx, cs)
        return _apply_blocks(v, scale, zp, m)

    def dequantize(self, name: str | None = None) -> dict[str, npt.NDArray[Any]]:
        """``x̂ = (code − zero_point) · scale`` per block, as float32; with ``name`` only that tensor.
        Tensors left as they are come back as stored (floats widened to float32)."""
        names = [name] if name is not None else self.quantized + self.passthrough
        out: dict[str, npt.NDArray[Any]] = {}
        for n in names:
            if n in self.metadata["tensors"]:
                out[n] = self._dequantize_one(n)
            else:
                t = self.tensor(n)
                out[n] = t.astype(np.float32) if t.dtype.kind == "f" else np.array(t)
        return out


def _apply_blocks(v: npt.NDArray[Any], scale: npt.NDArray[np.float32], zp: npt.NDArray[Any] | None,
                  m: Mapping[str, Any]) -> npt.NDArray[np.float32]:
    """Broadcast scale/zero point over the CONTRACT block view of ``v`` and undo it."""
    shape = v.shape
    gran = m["granularity"]
    if gran == "tensor":
        return _affine(v, zp, scale).reshape(shape)
    if gran == "group" and v.ndim <= 1:
        rows = v.reshape(1, -1)
        axis = 0
    else:
        axis = int(m["axis"]) % v.ndim
        rows = np.moveaxis(v, axis, 0).reshape(shape[axis], -1)
    if gran == "channel":
        out = _affine(rows, None if zp is None else zp[:, None], scale[:, None])
    else:
        g = int(m["group_size"])
        blocks = rows.reshape(rows.shape[0], -1, g)
        out = _affine(blocks, None if zp is None else zp[..., None], scale[..., None]).reshape(rows.shape)
    if gran == "group" and v.ndim <= 1:
        return out.reshape(shape)
    moved = (shape[axis], *shape[:axis], *shape[axis + 1:])
    return np.ascontiguousarray(np.moveaxis(out.reshape(moved), 0, axis))


def _apply_columns(v: npt.NDArray[Any], scale: npt.NDArray[np.float32], zp: npt.NDArray[Any] | None,
                   g_idx: npt.NDArray[Any] | None, channel_scale: npt.NDArray[Any] | None) -> npt.NDArray[np.float32]:
    """A ``[rows, cols]`` weight whose column ``j`` takes group ``g_idx[j]``'s scale and zero point (else
    ``j // group_size``) and is divided by ``channel_scale[j]`` (CONTRACT §10)."""
    rows = v.shape[0]
    codes = v.reshape(rows, -1)
    cols = codes.shape[1]
    s2 = scale.reshape(rows, -1)
    if g_idx is not None:
        idx = g_idx.astype(np.int64)
        if idx.shape != (cols,) or (idx.size and (idx.min() < 0 or idx.max() >= s2.shape[1])):
            raise ArtifactError(f"g_idx of shape {list(idx.shape)} does not index the {s2.shape[1]} groups of "
                                f"{cols} columns")
    else:
        idx = np.arange(cols) // (cols // s2.shape[1])
    centered = codes.astype(np.float32) if zp is None else codes - zp.reshape(rows, -1)[:, idx]
    out = (centered.astype(np.float32) * s2[:, idx]).astype(np.float32)
    if channel_scale is not None:
        out = (out / channel_scale.astype(np.float32).reshape(1, cols)).astype(np.float32)
    return out.reshape(v.shape)


def _affine(v: npt.NDArray[Any], zp: npt.NDArray[Any] | None, scale: npt.NDArray[np.float32]
            ) -> npt.NDArray[np.float32]:
    centered = v if zp is None else v - zp
    return (centered.astype(np.float32) * scale).astype(np.float32)


def read_artifact(path_or_bytes: str | os.PathLike[str] | bytes | bytearray | memoryview) -> ArtifactFile:
    """Open an artifact from a path (memory-mapped, read-only) or from bytes."""
    if isinstance(path_or_bytes, bytes | bytearray | memoryview):
        buf = np.frombuffer(path_or_bytes, dtype=np.uint8)
    else:
        if os.path.getsize(path_or_bytes) == 0:
            raise ArtifactError("empty file")
        buf = np.memmap(path_or_bytes, dtype=np.uint8, mode="r")
    return ArtifactFile(buf)
