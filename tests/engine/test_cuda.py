"""CPU vs CUDA parity: the same codes, scales and zero points on both devices (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from quantd.engine.packing import pack, unpack
from quantd.engine.primitives import dequantize, quantize
from quantd.engine.stats import error_stats
from quantd_client import Scheme

pytestmark = pytest.mark.cuda

SCHEMES = [
    {"dtype": "int8", "granularity": "channel", "symmetric": True},
    {"dtype": "int4", "granularity": "group", "group_size": 128},
    {"dtype": "int4", "granularity": "group", "group_size": 64, "symmetric": True},
    {"dtype": "int3", "granularity": "channel", "axis": 1},
    {"dtype": "uint4", "granularity": "tensor"},
    {"dtype": "nf4", "granularity": "group", "group_size": 64},
    {"dtype": "fp8_e4m3", "granularity": "channel"},
    {"dtype": "fp8_e5m2", "granularity": "tensor"},
    {"dtype": "bfloat16"},
    {"dtype": "int8", "granularity": "channel", "observer": "mse"},
]


@pytest.mark.parametrize("spec", SCHEMES, ids=lambda s: "-".join(str(v) for v in s.values()))
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_cpu_cuda_parity(spec: dict[str, object], in_dtype: torch.dtype) -> None:
    scheme = Scheme.model_validate(spec)
    x = (torch.randn(256, 512, generator=torch.Generator().manual_seed(0)) * 0.02).to(in_dtype)
    cpu = quantize(x, scheme)
    gpu = quantize(x.cuda(), scheme)
    assert gpu.codes.device.type == "cuda"
    # Division and rounding are IEEE-exact on both devices; allow no difference in the codes.
    assert torch.equal(cpu.codes.float(), gpu.codes.cpu().float())
    if cpu.scale is not None:
        assert gpu.scale is not None and torch.equal(cpu.scale, gpu.scale.cpu())
    if cpu.zero_point is not None:
        assert gpu.zero_point is not None and torch.equal(cpu.zero_point, gpu.zero_point.cpu())
    assert torch.equal(dequantize(cpu), dequantize(gpu).cpu())
    s_cpu = error_stats(x, dequantize(cpu), cpu)
    s_gpu = error_stats(x.cuda(), dequantize(gpu), gpu)
    assert s_gpu.mse == pytest.approx(s_cpu.mse, rel=1e-9)
    assert s_gpu.clipped_fraction == s_cpu.clipped_fraction


@pytest.mark.parametrize("bits", range(1, 9))
def test_packing_parity(bits: int) -> None:
    offsets = torch.randint(0, 2**bits, (100_003,), dtype=torch.uint8)
    packed = pack(offsets.cuda(), bits)
    assert torch.equal(packed.cpu(), pack(offsets, bits))
    assert torch.equal(unpack(packed, bits, offsets.numel()).cpu(), offsets)
