"""Upload sources and a streamed multipart/form-data body.

Files given by path are never read whole: the body is a generator of chunks, re-opened for each
attempt (so a retry can send it again). In-memory sources (NumPy arrays serialised as .npy/.npz,
bytes) replay from memory; a caller's open file object replays only if it is seekable.
"""

from __future__ import annotations

import io
import os
import secrets
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, cast, runtime_checkable

import numpy as np

from ._artifact import safetensors_header
from ._exceptions import ValidationError

CHUNK_SIZE = 1 << 20


@runtime_checkable
class TensorLike(Protocol):
    """A torch tensor (or parameter), recognised without importing torch."""

    def detach(self) -> Any: ...

    def numel(self) -> int: ...


UploadInput = str | os.PathLike[str] | bytes | np.ndarray | TensorLike | Mapping[str, Any] | IO[bytes]

# safetensors' dtype names of the torch dtypes a weights file holds (looked up by the dtype's name).
_SAFETENSORS_DTYPES = {
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2", "int8": "I8", "uint8": "U8", "int16": "I16", "int32": "I32", "int64": "I64",
    "bool": "BOOL",
}


def _is_torch_tensor(x: object) -> bool:
    return type(x).__module__.split(".")[0] == "torch" and isinstance(x, TensorLike)


def _safetensors_stream(tensors: Mapping[str, Any]) -> tuple[io.BytesIO, int]:
    """Torch tensors (any device, bfloat16 and float8 included, parameters that require grad) and NumPy arrays
    as one safetensors file in memory, written here tensor by tensor (the file once, plus one tensor's CPU copy
    at a time): torch is imported only because the caller already holds tensors."""
    import torch

    entries: list[tuple[str, str, list[int], int]] = []
    values: list[Any] = []
    for key, value in tensors.items():
        if not isinstance(key, str):
            raise ValidationError(f"tensor names must be strings; got {key!r}")
        if key == "__metadata__":
            raise ValidationError("a tensor cannot be named '__metadata__' (safetensors' metadata key)")
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                raise ValidationError(f"tensor {key!r}: object arrays cannot be uploaded (no pickles)")
            name = value.dtype.newbyteorder("=").name  # its torch dtype (the array is converted when written)
            nbytes = value.size * value.itemsize
        elif isinstance(value, torch.Tensor):
            name = str(value.dtype).removeprefix("torch.")
            nbytes = value.numel() * value.element_size()
        else:
            raise ValidationError(f"tensor {key!r}: a {type(value).__name__} is not a tensor or an array")
        dtype = _SAFETENSORS_DTYPES.get(name)
        if dtype is None:
            raise ValidationError(f"tensor {key!r}: dtype {name} has no safetensors name")
        entries.append((key, dtype, list(value.shape), nbytes))
        values.append(value)
    out = io.BytesIO()
    out.write(safetensors_header(entries))
    for value in values:  # one tensor's contiguous CPU (and native byte order) copy at a time
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("=")))
        t = value.detach().to("cpu").contiguous()
        out.write(t.reshape(-1).view(torch.uint8).numpy().data)
        del t, value
    size = out.tell()
    out.seek(0)
    return out, size


@dataclass
class FilePart:
    """One ``file``-like form field. Exactly one of ``path``, ``data``, ``stream`` is set."""

    field: str
    filename: str
    size: int
    path: Path | None = None
    data: bytes | None = None
    stream: IO[bytes] | None = None
    content_type: str = "application/octet-stream"
    start: int = 0  # where a caller's seekable stream began

    @property
    def replayable(self) -> bool:
        return self.stream is None or _seekable(self.stream)

    def chunks(self, chunk_size: int | None = None) -> Iterator[bytes]:
        chunk_size = chunk_size or CHUNK_SIZE
        if self.data is not None:
            view = memoryview(self.data)
            for i in range(0, len(view), chunk_size):
                yield bytes(view[i:i + chunk_size])
            return
        if self.path is not None:
            with open(self.path, "rb") as f:
                yield from iter(lambda: f.read(chunk_size), b"")
            return
        stream = self.stream
        if stream is None:
            return
        if _seekable(stream):
            stream.seek(self.start)
        yield from iter(lambda: stream.read(chunk_size), b"")


def _seekable(f: IO[bytes]) -> bool:
    try:
        return bool(f.seekable())
    except (AttributeError, ValueError):
        return False


def _npy_bytes(arr: np.ndarray, what: str) -> bytes:
    if arr.dtype.hasobject:
        raise ValidationError(f"{what}: object arrays cannot be uploaded (no pickles); got dtype {arr.dtype}")
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def make_file_part(x: UploadInput, *, name: str | None = None, field: str = "file") -> FilePart:
    """A NumPy array (sent as ``<name or 'tensor'>.npy``), a dict of arrays (an ``.npz``, no pickle), a torch
    tensor or a dict holding torch tensors, such as a ``state_dict()`` (a ``.safetensors``, bfloat16 kept), a
    path (streamed from disk), bytes (``name`` is the filename) or a binary file object."""
    if _is_torch_tensor(x) or (isinstance(x, Mapping) and any(_is_torch_tensor(v) for v in x.values())):
        blob, size = _safetensors_stream(x if isinstance(x, Mapping) else {name or "tensor": x})
        filename = f"{name or ('tensors' if isinstance(x, Mapping) else 'tensor')}.safetensors"
        return FilePart(field, filename, size, stream=blob)
    if isinstance(x, np.ndarray):
        data = _npy_bytes(x, f"tensor {name or 'tensor'!r}")
        return FilePart(field, f"{name or 'tensor'}.npy", len(data), data=data)
    if isinstance(x, Mapping):
        arrays: dict[str, np.ndarray] = {}
        for key, value in x.items():
            if not isinstance(key, str):
                raise ValidationError(f"tensor names must be strings; got {key!r}")
            arr = np.asarray(value)
            if arr.dtype.hasobject:
                raise ValidationError(f"tensor {key!r}: object arrays cannot be uploaded (no pickles)")
            arrays[key] = arr
        buf = io.BytesIO()
        np.savez(buf, allow_pickle=False, **arrays)
        data = buf.getvalue()
        return FilePart(field, f"{name or 'tensors'}.npz", len(data), data=data)
    if isinstance(x, (bytes, bytearray, memoryview)):
        data = bytes(x)
        return FilePart(field, name or "upload.bin", len(data), data=data)
    if isinstance(x, (str, os.PathLike)):
        path = Path(x)
        if not path.is_file():
            raise FileNotFoundError(f"{field}: no such file: {path}")
        return FilePart(field, name or path.name, path.stat().st_size, path=path)
    if hasattr(x, "read"):
        stream = cast(IO[bytes], x)
        start = stream.tell() if _seekable(stream) else 0
        try:
            size = os.fstat(stream.fileno()).st_size - start
        except (AttributeError, OSError, io.UnsupportedOperation):
            if not _seekable(stream):
                raise ValidationError(f"{field}: a non-seekable stream of unknown size cannot be uploaded; "
                                      "pass a path or bytes") from None
            size = stream.seek(0, os.SEEK_END) - start
            stream.seek(start)
        filename = name or Path(str(getattr(stream, "name", "upload.bin"))).name
        return FilePart(field, filename, size, stream=stream, start=start)
    raise TypeError(f"cannot upload a {type(x).__name__}: pass a NumPy array, a torch tensor, a dict of either, "
                    "a path or bytes")


def directory_parts(root: Path) -> list[FilePart]:
    """A model directory as ``file`` parts, one per regular file, each named by its relative POSIX path
    (sorted; streamed from disk like any path)."""
    parts = [FilePart("file", p.relative_to(root).as_posix(), p.stat().st_size, path=p)
             for p in sorted(root.rglob("*")) if p.is_file()]
    if not parts:
        raise ValidationError(f"{root}: an empty directory has nothing to quantize")
    return parts


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', "%22").replace("\r", "%0D").replace("\n", "%0A")


class MultipartBody:
    """multipart/form-data with a known Content-Length, produced chunk by chunk."""

    def __init__(self, fields: Mapping[str, str], files: list[FilePart]) -> None:
        self.boundary = secrets.token_hex(16)
        self.fields = dict(fields)
        self.files = files
        self._heads: list[bytes] = []
        for k, v in self.fields.items():
            self._heads.append(
                f'--{self.boundary}\r\nContent-Disposition: form-data; name="{_quote(k)}"\r\n\r\n'.encode()
                + v.encode() + b"\r\n")
        self._file_heads = [
            (f'--{self.boundary}\r\nContent-Disposition: form-data; name="{_quote(f.field)}"; '
             f'filename="{_quote(f.filename)}"\r\nContent-Type: {f.content_type}\r\n\r\n').encode()
            for f in files
        ]
        self._tail = f"--{self.boundary}--\r\n".encode()

    @property
    def content_type(self) -> str:
        return f"multipart/form-data; boundary={self.boundary}"

    @property
    def content_length(self) -> int:
        return (sum(map(len, self._heads)) + sum(map(len, self._file_heads))
                + sum(f.size + 2 for f in self.files) + len(self._tail))

    @property
    def replayable(self) -> bool:
        return all(f.replayable for f in self.files)

    @property
    def headers(self) -> dict[str, str]:
        return {"Content-Type": self.content_type, "Content-Length": str(self.content_length)}

    def iter_bytes(self, on_sent: Callable[[int], None] | None = None) -> Iterator[bytes]:
        def emit(chunk: bytes) -> bytes:
            if on_sent is not None:
                on_sent(len(chunk))
            return chunk

        for head in self._heads:
            yield emit(head)
        for head, f in zip(self._file_heads, self.files, strict=True):
            yield emit(head)
            sent = 0
            for chunk in f.chunks():
                sent += len(chunk)
                yield emit(chunk)
            if sent != f.size:
                raise ValidationError(f"{f.field}: {f.filename} changed while uploading "
                                      f"({sent} bytes read, {f.size} expected)")
            yield emit(b"\r\n")
        yield emit(self._tail)

    async def aiter_bytes(self, on_sent: Callable[[int], None] | None = None) -> AsyncIterator[bytes]:
        # Local-disk reads of 1 MiB are short; they run inline rather than hopping threads per chunk.
        for chunk in self.iter_bytes(on_sent):
            yield chunk
