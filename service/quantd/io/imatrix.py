"""llama.cpp importance matrices (``llama-imatrix`` output), the calibration of GGUF jobs.

Two formats: the legacy binary ``.dat`` (``int32 n_entries``, then per entry ``int32 len, name, int32
ncall, int32 nval, float32[nval]`` — sums of squared activations times ``ncall / count`` — then the
chunk count and the dataset name) and the GGUF one (``<tensor>.in_sum2`` ``[nmat, n]`` and
``<tensor>.counts`` ``[nmat, 1]``). Both become, per weight name, the mean squared activation of each
input column, ``[nmat, n]`` float32 (``nmat`` > 1 for stacked experts), as ``llama-quantize`` computes it
(legacy values divided by ``ncall``, GGUF sums by their counts). Every length is checked against the
file's size before it is read.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import torch

from quantd.errors import MalformedInputError

from .gguf_file import GGUFReader


def _legacy(path: Path) -> dict[str, torch.Tensor]:
    data = path.read_bytes()
    pos = 0

    def i32(what: str) -> int:
        nonlocal pos
        if pos + 4 > len(data):
            raise MalformedInputError(f"importance matrix truncated at byte {pos} ({what})")
        (v,) = struct.unpack_from("<i", data, pos)
        pos += 4
        return int(v)

    n = i32("entry count")
    if not 0 < n <= len(data) // 12:
        raise MalformedInputError(f"importance matrix claims {n} entries; the file cannot hold them")
    out: dict[str, torch.Tensor] = {}
    for _ in range(n):
        length = i32("name length")
        if not 0 < length <= min(4096, len(data) - pos):
            raise MalformedInputError(f"importance matrix: bad name length {length} at byte {pos - 4}")
        name = data[pos:pos + length].decode("utf-8", errors="replace")
        pos += length
        ncall = i32(f"call count of {name!r}")
        nval = i32(f"value count of {name!r}")
        if nval <= 0 or nval * 4 > len(data) - pos:
            raise MalformedInputError(f"importance matrix entry {name!r} claims {nval} values; the file cannot "
                                      "hold them")
        values = np.frombuffer(data, dtype="<f4", count=nval, offset=pos).astype(np.float32)
        pos += nval * 4
        if ncall > 0:
            values = (values / ncall).astype(np.float32)
        out[name] = torch.from_numpy(values.copy()).reshape(1, -1)
    return out


def _gguf(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    with GGUFReader(path) as r:
        names = {t.name for t in r.file.tensors}
        for t in r.file.tensors:
            if not t.name.endswith(".in_sum2"):
                continue
            base = t.name.removesuffix(".in_sum2")
            if base + ".counts" not in names:
                raise MalformedInputError(f"importance matrix: {t.name!r} has no {base + '.counts'!r}")
            sums = r.load(t.name, "cpu").float()
            counts = r.load(base + ".counts", "cpu").float().reshape(-1, 1)
            sums = sums.reshape(counts.shape[0], -1) if sums.numel() % counts.shape[0] == 0 else None  # type: ignore[assignment]
            if sums is None:
                raise MalformedInputError(f"importance matrix: {t.name!r} does not match its counts")
            out[base] = torch.where(counts > 0, sums / counts.clamp(min=1), torch.ones_like(sums))
    return out


def load_imatrix(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Weight name → ``[nmat, n]`` float32 importance (mean squared input activation per column)."""
    p = Path(path)
    with p.open("rb") as f:
        head = f.read(4)
    table = _gguf(p) if head == b"GGUF" else _legacy(p)
    for name, v in table.items():
        if not bool(torch.isfinite(v).all()) or bool((v < 0).any()):
            raise MalformedInputError(f"importance matrix entry {name!r} has negative or non-finite values")
    return table


