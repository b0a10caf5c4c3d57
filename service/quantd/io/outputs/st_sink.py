"""A plain safetensors file written as a stream: tensors are appended in the order they come, and the
header, whose room is reserved up front for every tensor that may be written, is filled in at the end
(padded with spaces, which the format allows). For formats whose readers expect no quantd metadata."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from ..artifact import OutputTensor
from ..formats import TORCH_TO_ST


class SafetensorsSink:
    """Writes ``dst`` (through ``dst.tmp``). ``required`` tensors must all be written; ``optional``
    ones may be (a result that only some methods give, such as ``g_idx``). Each is written once with
    exactly its planned dtype and shape; the header carries ``metadata`` (string values)."""

    def __init__(self, dst: str | os.PathLike[str], required: Sequence[OutputTensor],
                 optional: Sequence[OutputTensor] = (), *, metadata: Mapping[str, str] | None = None) -> None:
        self.dst = Path(dst)
        self.tmp = self.dst.with_name(self.dst.name + ".tmp")
        self._planned = {o.name: o for o in (*required, *optional)}
        if len(self._planned) != len(required) + len(optional):
            raise ValueError("duplicate output tensor names")
        self._required = {o.name for o in required}
        self._metadata = dict(metadata or {})
        self._entries: dict[str, dict[str, Any]] = {}
        self._pos = 0
        total = sum(o.nbytes for o in self._planned.values())
        widest = {o.name: {"dtype": o.dtype, "shape": list(o.shape), "data_offsets": [total, total]}
                  for o in self._planned.values()}
        n = len(self._header(widest))
        self._header_len = n + (-(8 + n)) % 8  # data starts 8-byte aligned
        self._f = self.tmp.open("wb")
        self._f.write(self._header_len.to_bytes(8, "little"))
        self._f.write(b" " * self._header_len)

    def _header(self, entries: Mapping[str, Any]) -> bytes:
        head: dict[str, Any] = {"__metadata__": self._metadata} if self._metadata else {}
        head.update(entries)
        return json.dumps(head, separators=(",", ":")).encode()

    @property
    def total_bytes(self) -> int:
        """The size of what is written so far (the finished file's once every tensor is in)."""
        return 8 + self._header_len + self._pos

    def write(self, name: str, tensor: torch.Tensor) -> None:
        o = self._planned.get(name)
        if o is None or name in self._entries:
            raise RuntimeError(f"output tensor {name!r} is not planned or already written")
        if TORCH_TO_ST.get(tensor.dtype) != o.dtype or tuple(tensor.shape) != o.shape:
            raise RuntimeError(f"output tensor {name!r}: got {tensor.dtype} {list(tensor.shape)}, planned "
                               f"{o.dtype} {list(o.shape)}")
        raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        self._f.write(raw.data)
        self._entries[name] = {"dtype": o.dtype, "shape": list(o.shape),
                               "data_offsets": [self._pos, self._pos + o.nbytes]}
        self._pos += o.nbytes

    def written(self, name: str) -> bool:
        return name in self._entries

    def finish(self, summary: Mapping[str, Any] | None = None,
               tensor_stats: Mapping[str, Mapping[str, Any]] | None = None) -> int:
        """Fill in the header, fsync, rename into place; returns the file's size. (The statistics live in
        the job's report: this format's readers expect no quantd metadata.)"""
        missing = self._required - set(self._entries)
        if missing:
            raise RuntimeError(f"output tensors never written: {sorted(missing)[:5]}")
        raw = self._header(self._entries)
        if len(raw) > self._header_len:
            raise RuntimeError(f"header of {len(raw)} bytes overflows its reserved {self._header_len} bytes")
        self._f.seek(8)
        self._f.write(raw + b" " * (self._header_len - len(raw)))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.dst)
        return self.total_bytes

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> SafetensorsSink:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if et is not None or not self._f.closed:
            self.abort()
