"""Input format detection by content (magic bytes), and the dtype spellings of each container.

The extension of an upload is never trusted: a ``.bin`` may be a safetensors file, a ``.pt`` may
be junk. Detection only looks at the first bytes (and, for zips, the member names).
"""

from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path
from typing import BinaryIO, Literal

import torch

from quantd.errors import MalformedInputError, UnsupportedFormatError

Format = Literal["safetensors", "pytorch", "npy", "npz", "gguf"]

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"
# An empty zip (no members) starts with the end-of-central-directory record.
ZIP_EMPTY_MAGIC = b"PK\x05\x06"

# safetensors dtype string -> torch dtype. Every dtype safetensors defines that torch can hold.
ST_TO_TORCH: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
TORCH_TO_ST: dict[torch.dtype, str] = {v: k for k, v in ST_TO_TORCH.items()}
ST_ITEMSIZE: dict[str, int] = {k: torch.empty((), dtype=v).element_size() for k, v in ST_TO_TORCH.items()}

# Float dtypes the pipeline may quantize; everything else passes through as it is.
QUANTIZABLE: frozenset[torch.dtype] = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the spelling used in reports and TensorInfo)."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dt


def is_safetensors_head(head: bytes) -> bool:
    """The first bytes of a file (≥ 9) look like a safetensors header."""
    # The header length is NOT bounded here: a lying length is a malformed safetensors file (422 with
    # a precise detail from the header validation), not an unknown format.
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return n >= 2 and head[8:9] == b"{"


def _safetensors_header_fits(f: BinaryIO, head: bytes) -> bool:
    """The header length of a safetensors-looking ``head`` (the first bytes of ``f``) leaves room for the
    header in the file, and the header's last byte closes its JSON object (``}``, or the whitespace it may be
    padded with)."""
    (n,) = struct.unpack("<Q", head[:8])
    try:
        if 8 + n > f.seek(0, os.SEEK_END):
            return False
        f.seek(8 + n - 1)
        return f.read(1) in (b"}", b" ", b"\n", b"\t", b"\r")  # JSON's end, or the whitespace after it
    except OSError:
        return False


def _zip_kind(path: Path) -> Format:
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise MalformedInputError(f"corrupt zip container: {e}") from None
    # torch.save writes "<archive>/data.pkl" (usually "archive/data.pkl"; older: the file stem).
    if any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
        return "pytorch"
    if names and any(n.endswith(".npy") for n in names):
        return "npz"
    if not names:
        return "npz"  # np.savez() with no arrays: a valid, empty archive
    raise UnsupportedFormatError("zip file that is neither a PyTorch checkpoint nor a NumPy .npz")


def detect_format(path: str | os.PathLike[str]) -> Format:
    """The format of ``path`` from its content.

    - safetensors: 8-byte little-endian header length, then ``{``
    - PyTorch: a zip with a ``data.pkl`` member, or a legacy pickle (``\\x80`` + protocol 2…5)
    - npy: ``\\x93NUMPY``; npz: a zip of ``.npy`` members

    Anything else raises :class:`UnsupportedFormatError` (415).
    """
    p = Path(path)
    with p.open("rb") as f:
        head = f.read(16)
        # checked before the pickle magic: a header length of 640, 896, 1152 or 1408 bytes (mod 65536) starts
        # the file with ``\x80`` and a byte 2…5, as a pickle does
        fitting_safetensors = is_safetensors_head(head) and _safetensors_header_fits(f, head)
    if not head:
        raise MalformedInputError("the file is empty (0 bytes): expected safetensors, a PyTorch checkpoint, "
                                  ".npy or .npz")
    if head.startswith(NPY_MAGIC):
        return "npy"
    if head.startswith(b"GGUF"):  # llama.cpp
        return "gguf"
    if head.startswith(ZIP_MAGIC) or head.startswith(ZIP_EMPTY_MAGIC):
        return _zip_kind(p)
    if fitting_safetensors:
        return "safetensors"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "pytorch"
    if is_safetensors_head(head):
        return "safetensors"
    raise UnsupportedFormatError(
        "unrecognised file content: expected safetensors, a PyTorch checkpoint, .npy, .npz or GGUF "
        f"(first bytes {head[:8]!r})"
    )
