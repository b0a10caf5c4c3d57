"""Peak memory follows the largest tensor, not the file.

Two fresh subprocesses quantize a safetensors file of ONE 32 MiB tensor and of FOUR such tensors
(128 MiB). Their peak RSS (ru_maxrss) must be nearly the same: a reader or writer that held the
file would add ~96 MiB.

glibc's dynamic mmap threshold lets freed 32 MiB buffers be followed by heap allocations that
fragment the heap (tens of MiB of growth that depends on allocation order, not on this code), so the
children run with a fixed ``MALLOC_MMAP_THRESHOLD_``: what is measured is what quantd holds on to.
Workers can do the same (env var, or ``mallopt(M_MMAP_THRESHOLD)``).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROWS, COLS = 2048, 4096  # 32 MiB of float32
MIB = 1024 * 1024

_CHILD = r"""
import json, resource, sys
import torch
from quantd.io import quantize_file
from quantd_client import QuantConfig, Scheme
torch.set_num_threads(1)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
report = quantize_file(sys.argv[1], sys.argv[2], QuantConfig(scheme=Scheme(dtype="int4", group_size=128)),
                       device="cpu")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"base_kib": base, "peak_kib": peak, "quantized": report.summary.tensors_quantized}))
"""


def _write_file(path: Path, n: int) -> None:
    """A safetensors file written tensor by tensor (so the test itself stays small too)."""
    nbytes = ROWS * COLS * 4
    header = {f"layer.{i}.weight": {"dtype": "F32", "shape": [ROWS, COLS],
                                    "data_offsets": [i * nbytes, (i + 1) * nbytes]} for i in range(n)}
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    g = torch.Generator().manual_seed(0)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _ in range(n):
            f.write(torch.randn(ROWS, COLS, generator=g).numpy().tobytes())


def _peak(tmp_path: Path, n: int) -> dict[str, int]:
    src, dst = tmp_path / f"m{n}.safetensors", tmp_path / f"q{n}.safetensors"
    _write_file(src, n)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1024 * 1024)}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(dst)], capture_output=True, text=True,
                         timeout=300, check=True, env=env)
    src.unlink()
    result: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["quantized"] == n
    return result


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is KiB on Linux")
def test_peak_memory_follows_largest_tensor(tmp_path: Path) -> None:
    one = _peak(tmp_path, 1)
    four = _peak(tmp_path, 4)
    grow_one = (one["peak_kib"] - one["base_kib"]) / 1024
    grow_four = (four["peak_kib"] - four["base_kib"]) / 1024
    print(f"peak RSS growth: 1 x 32 MiB file: {grow_one:.0f} MiB; 4 x 32 MiB file: {grow_four:.0f} MiB")
    # the 128 MiB file may cost at most half a tensor more than the 32 MiB one
    assert grow_four - grow_one < 16, (grow_one, grow_four)
    # and one tensor's working set stays a small multiple of the tensor
    assert grow_one < 6 * 32, grow_one
