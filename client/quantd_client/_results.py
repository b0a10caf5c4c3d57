"""Artifact: the result of a synchronous quantize, in memory or saved to a path."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pydantic

from ._exceptions import QuantdError
from ._schemas import ErrorStats, Summary

_MAX_HEADER = 100 * 1024 * 1024


_GGUF_ARTIFACT = ("a GGUF artifact (output \"gguf\") holds ggml blocks and no quantd metadata: run it with llama.cpp, "
                  "read it with gguf-py (gguf.GGUFReader, gguf.quants.dequantize); the per-tensor statistics are "
                  "in the job's report")


def read_quantd_metadata(head: bytes) -> dict[str, Any]:
    """``__metadata__["quantd"]`` of a safetensors artifact, parsed from its first bytes."""
    if len(head) < 8:
        raise QuantdError("artifact is too short to be a safetensors file")
    if head[:4] == b"GGUF":
        raise QuantdError(_GGUF_ARTIFACT)
    (n,) = struct.unpack("<Q", head[:8])
    if n > _MAX_HEADER or len(head) < 8 + n:
        raise QuantdError(f"artifact header length {n} is out of range")
    try:
        header = json.loads(head[8:8 + n])
        raw = header.get("__metadata__", {}).get("quantd")
        meta = json.loads(raw) if isinstance(raw, str) else {}
    except (ValueError, AttributeError) as e:
        raise QuantdError(f"artifact header is not valid JSON: {e}") from None
    return meta if isinstance(meta, dict) else {}


class Artifact:
    """A quantized artifact (CONTRACT §5). ``data`` holds the bytes, or ``path`` the saved file."""

    def __init__(self, *, data: bytes | None = None, path: str | os.PathLike[str] | None = None,
                 summary: dict[str, Any] | None = None, request_id: str | None = None) -> None:
        if (data is None) == (path is None):
            raise ValueError("an Artifact holds either data or a path")
        self._data = data
        self.path = Path(path) if path is not None else None
        self.summary_raw: dict[str, Any] = summary or {}
        self.request_id = request_id
        self._meta: dict[str, Any] | None = None
        self._gguf: bool | None = None

    def __repr__(self) -> str:
        where = f"path={str(self.path)!r}" if self.path else f"{len(self._data or b'')} bytes"
        try:  # a repr never raises: a missing file or foreign bytes show as such
            if self.is_gguf:
                return f"Artifact({where}, format='gguf')"
            return f"Artifact({where}, tensors={len(self.metadata.get('tensors', {}))})"
        except (OSError, QuantdError) as e:
            return f"Artifact({where}, unreadable: {e})"

    @property
    def data(self) -> bytes:
        if self._data is not None:
            return self._data
        return Path(self.path or "").read_bytes()

    @property
    def nbytes(self) -> int:
        return len(self._data) if self._data is not None else os.path.getsize(self.path or "")

    @property
    def metadata(self) -> dict[str, Any]:
        """The parsed ``quantd`` metadata: format_version, tensors, summary."""
        if self._meta is None:
            if self._data is not None:
                self._meta = read_quantd_metadata(self._data[:_MAX_HEADER + 8])
            else:
                with open(self.path or "", "rb") as f:
                    head = f.read(8)
                    n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
                    self._meta = read_quantd_metadata(head + f.read(min(n, _MAX_HEADER)))
        return self._meta

    @property
    def summary(self) -> Summary | None:
        """The run's summary (the ``Quantd-Summary`` header, else the artifact's own)."""
        raw = self.summary_raw or ({} if self.is_gguf else self.metadata.get("summary")) or {}
        try:
            return Summary.model_validate(raw)
        except pydantic.ValidationError:
            return None

    @property
    def stats(self) -> dict[str, ErrorStats]:
        """Per-tensor error statistics, for the tensors that were quantized and carry them."""
        out: dict[str, ErrorStats] = {}
        meta = {} if self.is_gguf else self.metadata  # a GGUF's statistics come only with the summary
        for source in (meta.get("tensors", {}), self.summary_raw.get("tensors", {})):
            items = source.items() if isinstance(source, dict) else (
                (t.get("name"), t) for t in source if isinstance(t, dict))
            for name, entry in items:
                stats = entry.get("stats") if isinstance(entry, dict) else None
                if name and isinstance(stats, dict) and name not in out:
                    out[str(name)] = ErrorStats.model_validate(stats)
        return out

    @property
    def is_gguf(self) -> bool:
        """The artifact is a GGUF file (output ``"gguf"``), not quantd's safetensors (read once)."""
        if self._gguf is None:
            if self._data is not None:
                self._gguf = self._data[:4] == b"GGUF"
            else:
                with open(self.path or "", "rb") as f:
                    self._gguf = f.read(4) == b"GGUF"
        return self._gguf

    def _source(self) -> bytes | Path:
        return self._data if self._data is not None else Path(self.path or "")

    def dequantize(self) -> dict[str, np.ndarray]:
        """Every tensor back in floating point (float32; NumPy only)."""
        from ._artifact import read_artifact

        if self.is_gguf:
            raise QuantdError(_GGUF_ARTIFACT)
        result: dict[str, np.ndarray] = read_artifact(self._source()).dequantize()
        return result

    def to_torch(self) -> dict[str, Any]:
        """:meth:`dequantize` as torch tensors (needs torch installed)."""
        try:
            import torch
        except ImportError as e:
            raise ImportError("Artifact.to_torch() needs torch; `pip install torch` or use dequantize()") from e
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in self.dequantize().items()}

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the artifact to ``path`` (atomically) and return it."""
        dst = Path(path)
        tmp = dst.with_name(dst.name + ".part")
        if self._data is not None:
            tmp.write_bytes(self._data)
        else:
            with open(self.path or "", "rb") as src, open(tmp, "wb") as out:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    out.write(chunk)
        os.replace(tmp, dst)
        return dst
