"""CPU vs CUDA parity (skipped without CUDA): the same codes, scales, zero points and packed bytes on both
devices, on CUDA's eager ops and through its compiled (Triton) kernels; statistics equal to 1e-12 relative."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from _device_schemes import DEVICE_SCHEMES
from quantd.engine import kernels
from quantd.engine.kernels.packing import pack_codes
from quantd.engine.packing import pack, unpack
from quantd.engine.primitives import dequantize, quantize
from quantd.engine.stats import error_stats, quantized_error_stats
from quantd.io.artifact import encode_quantized
from quantd_client import ErrorStats, Scheme

pytestmark = pytest.mark.cuda

SCHEMES = DEVICE_SCHEMES


@pytest.fixture(params=["eager", "compiled"])
def cuda_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """CUDA tensors through the eager ops, or through the compiled CUDA kernels at every size. The CPU side,
    the reference, runs eager (its compiled kernels equal its eager ops bit for bit: test_primitives). The
    record of kernels run is the test's own, so that the check at the end sees this test's kernels."""
    monkeypatch.setattr(kernels.KERNELS, "available", lambda: False)
    monkeypatch.setattr(kernels.KERNELS, "_warm", set())
    if request.param == "compiled":
        if kernels.cuda_options() is None:
            pytest.skip("this torch cannot compile CUDA kernels with eager CUDA's arithmetic (Triton or "
                        "Inductor's eager_numerics settings missing)")
        monkeypatch.setattr(kernels, "MIN_ELEMENTS", 0)
        kernels.KERNELS.reset(available=True)
    else:
        monkeypatch.setattr(kernels.KERNELS, "available_cuda", lambda: False)
    yield request.param
    assert not kernels.KERNELS.failed_cuda, kernels.KERNELS.failed_cuda  # compiled, not fallen back
    if request.param == "compiled":
        assert any(name.endswith("@cuda") for name, *_ in kernels.KERNELS._warm), "no CUDA kernel ran"
    kernels.KERNELS.reset()


def _weights(in_dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 512, generator=g) * 0.02
    x[3, 7] = 0.4  # an outlier, so that ranges, clipping and outlier counts are not all trivial
    x[5, :64] = 0.0  # an all-zero group
    x[9, 100] = 1e-41  # a subnormal: kept, not flushed to zero
    x[11, :128] = torch.linspace(-3e-39, 2e-39, 128)  # a block of subnormals (with float32 scales: a subnormal scale)
    return x.to(in_dtype)


def _assert_stats_close(a: ErrorStats, b: ErrorStats) -> None:
    for key, va in a.model_dump().items():
        vb = getattr(b, key)
        if isinstance(va, float) and isinstance(vb, float):
            assert (math.isnan(va) and math.isnan(vb)) or vb == pytest.approx(va, rel=1e-12, abs=1e-300), key
        else:
            assert va == vb, key


@pytest.mark.parametrize("spec", SCHEMES, ids=lambda s: "-".join(str(v) for v in s.values()))
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_cpu_cuda_parity(spec: dict[str, object], in_dtype: torch.dtype, cuda_path: str) -> None:
    scheme = Scheme.model_validate(spec)
    x = _weights(in_dtype)
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
    cpu_bytes, gpu_bytes = encode_quantized(cpu, "w"), encode_quantized(gpu, "w")
    assert cpu_bytes.keys() == gpu_bytes.keys()
    for key, value in cpu_bytes.items():
        assert torch.equal(value, gpu_bytes[key].cpu()), key
    _assert_stats_close(error_stats(x, dequantize(cpu), cpu), error_stats(x.cuda(), dequantize(gpu), gpu))
    _assert_stats_close(quantized_error_stats(x, cpu), quantized_error_stats(x.cuda(), gpu))


@pytest.mark.parametrize("bits", range(1, 9))
def test_packing_parity(bits: int, cuda_path: str) -> None:
    offsets = torch.randint(0, 2**bits, (100_000,), dtype=torch.uint8)
    packed = pack(offsets.cuda(), bits)
    assert torch.equal(packed.cpu(), pack(offsets, bits))
    assert torch.equal(unpack(packed, bits, offsets.numel()).cpu(), offsets)
    if cuda_path == "compiled":  # the artifact's packing kernel, from codes (a multiple of 8 of them)
        codes = (offsets.to(torch.int16) - (1 << (bits - 1))).to(torch.int8)
        fused = pack_codes(codes.cuda(), -(1 << (bits - 1)), bits)
        assert fused is not None and torch.equal(fused.cpu(), pack(offsets, bits))


def test_a_file_quantized_on_cuda_equals_the_cpu_run(tmp_path: Path, cuda_path: str) -> None:
    """The pipeline end to end: the same artifact tensors from a CUDA worker as from a CPU one."""
    from safetensors.torch import load_file, save_file

    from quantd.io.pipeline import quantize_file
    from quantd_client import QuantConfig

    root = tmp_path
    g = torch.Generator().manual_seed(3)
    save_file({"a.weight": torch.randn(384, 256, generator=g) * 0.05,
               "b.weight": (torch.randn(128, 512, generator=g) * 0.01).bfloat16(),
               "norm.weight": torch.ones(256)}, str(root / "in.safetensors"))
    config = QuantConfig.model_validate({"scheme": {"dtype": "int4", "granularity": "group", "group_size": 64},
                                         "skip_1d": True})
    reports = {}
    for device in ("cpu", "cuda"):
        reports[device] = quantize_file(root / "in.safetensors", root / f"{device}.safetensors", config,
                                        device=device)
    cpu, gpu = load_file(str(root / "cpu.safetensors")), load_file(str(root / "cuda.safetensors"))
    assert cpu.keys() == gpu.keys()
    for key, value in cpu.items():
        assert torch.equal(value, gpu[key]), key
    for a, b in zip(reports["cpu"].tensors, reports["cuda"].tensors, strict=True):
        assert a.name == b.name
        if a.stats is not None:
            assert b.stats is not None
            _assert_stats_close(a.stats, b.stats)
