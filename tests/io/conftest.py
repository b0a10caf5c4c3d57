from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest


def write_safetensors(path: Path, header: dict[str, Any], data: bytes, *, header_len: int | None = None) -> Path:
    """A safetensors file from a raw header dict and data bytes (may be made to lie on purpose)."""
    raw = json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


@pytest.fixture
def st_file(tmp_path: Path):
    def make(header: dict[str, Any], data: bytes, name: str = "m.safetensors", **kw: Any) -> Path:
        return write_safetensors(tmp_path / name, header, data, **kw)

    return make
