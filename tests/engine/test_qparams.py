"""qparams: rounding scales up to their dtype, and the compiled qparams kernel against eager torch."""

from __future__ import annotations

import pytest
import torch

from quantd.engine import kernels
from quantd.engine.qparams import choose_qparams, round_up_to, smallest_positive
from quantd_client import Scheme
from quantd_client._dtypes import DTYPES

_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def reference_round_up(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The nearest value of ``dtype``, one bit pattern up where that fell below ``s``, clamped."""
    r = s.to(dtype)
    below = r.to(s.dtype) < s
    r = (r.view(_BITS[dtype]) + below).view(dtype)
    return r.clamp(min=smallest_positive(dtype), max=torch.finfo(dtype).max)


def _hard_scales(dtype: torch.dtype) -> torch.Tensor:
    """Every finite non-negative value of a 16-bit ``dtype`` and its float64 neighbours just above and
    below, halfway points, random magnitudes across the whole float64 range, and the range ends."""
    gen = torch.Generator().manual_seed(0)
    exact = torch.arange(0, 0x7C00 if dtype == torch.float16 else 0x7F80, dtype=torch.int32)
    exact = exact.to(torch.int16).view(dtype).double()
    spread = torch.rand(1 << 16, generator=gen, dtype=torch.float64) * 10.0 ** torch.empty(
        1 << 16, dtype=torch.float64).uniform_(-50, 45, generator=gen)
    ends = torch.tensor([0.0, 2.0**-150, 2.0**-149, 2.0**-134, 2.0**-133, 2.0**-25, 2.0**-24, 1.5 * 2.0**-24,
                         2.0**-14 * (1 - 2.0**-30), 2.0**-14, 65504.0, 65505.0, 65520.0, 7e4, 3.3895e38, 3.4e38,
                         1e39, 1e300], dtype=torch.float64)
    nxt = torch.nextafter(exact, torch.tensor(float("inf"), dtype=torch.float64))
    prv = torch.nextafter(exact, torch.tensor(0.0, dtype=torch.float64))
    return torch.cat([exact, nxt, prv, (exact[1:] + exact[:-1]) / 2, exact * (1 + 2.0**-12), spread, ends])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("source", [torch.float64, torch.float32])
def test_round_up_to_half_types_is_the_smallest_value_not_below(dtype: torch.dtype, source: torch.dtype) -> None:
    s = _hard_scales(dtype).to(source)
    got = round_up_to(s, dtype)
    assert got.dtype == dtype
    want = reference_round_up(s, dtype)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    fits = s <= torch.finfo(dtype).max
    assert bool((got.double()[fits] >= s.double()[fits]).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("source", [torch.float64, torch.float32])
def test_round_up_to_half_types_keeps_nan(source: torch.dtype, dtype: torch.dtype) -> None:
    bits = torch.tensor([0x7FC00000, 0x7FFFFFFF, -1, 0x7F800001], dtype=torch.int32)  # NaN payloads, all-ones too
    s = torch.cat([bits.view(torch.float32).to(source), torch.tensor([float("nan"), 1.0], dtype=source)])
    got = round_up_to(s, dtype)
    assert bool(torch.isnan(got[:-1]).all()) and float(got[-1]) == 1.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_up_to_compiled_equals_eager(compiled: None, dtype: torch.dtype) -> None:
    s = _hard_scales(torch.float16 if dtype == torch.float32 else dtype)
    got = kernels.KERNELS.call("test_round_up_to", round_up_to, (dtype,), s, dtype)
    want = round_up_to(s, dtype)
    assert got is not None
    assert torch.equal(got.view(_BITS[dtype]), want.view(_BITS[dtype]))


QPARAM_CASES = [(d, s) for d, info in DTYPES.items() if info.kind not in ("float", "ggml") for s in (True, False)
                if (info.kind == "int" and (info.signed or not s)) or (info.kind != "int" and s)]


@pytest.mark.parametrize("dtype,symmetric", QPARAM_CASES)
@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16", "float32"])
def test_qparams_columns_compiled_equal_eager(compiled: None, dtype: str, symmetric: bool, scale_dtype: str) -> None:
    gen = torch.Generator().manual_seed(3)
    n = 4096
    mag = 10.0 ** torch.empty(n).uniform_(-30, 30, generator=gen)
    lo, hi = -torch.rand(n, generator=gen) * mag, torch.rand(n, generator=gen) * mag
    lo[:10], hi[5:15], lo[20:25] = 0.0, 0.0, 1.0  # zero sides, all-zero blocks, ranges not containing 0
    finite, scale, zp, s_col, z_col = kernels.quantize.qparams_columns(lo, hi, dtype=dtype, symmetric=symmetric,
                                                              scale_dtype=scale_dtype)
    want_scale, want_zp = choose_qparams(lo, hi, dtype=dtype, symmetric=symmetric, scale_dtype=scale_dtype)
    assert finite and torch.equal(scale, want_scale)
    assert torch.equal(s_col, want_scale.float().unsqueeze(1))
    if want_zp is None:
        assert zp is None and not bool(z_col.any())
    else:
        assert zp is not None and torch.equal(zp, want_zp) and torch.equal(z_col, want_zp.float().unsqueeze(1))
    for side, bad in ((hi, float("nan")), (lo, float("-inf")), (hi, float("inf"))):
        keep = float(side[7])
        side[7] = bad
        assert not kernels.quantize.qparams_columns(lo, hi, dtype=dtype, symmetric=symmetric, scale_dtype=scale_dtype)[0]
        side[7] = keep


@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("dtype", ["int8", "int4", "int3", "int2", "nf4", "fp8_e4m3", "fp8_e5m2"])
def test_symmetric_half_scales_in_float32_equal_the_float64_route(dtype: str, scale_dtype: str) -> None:
    """Symmetric float16/bfloat16 scales of float32 ranges are computed in float32 (``q = absmax / divisor``,
    one step up where ``q`` is a scale value below the quotient): the float64 route's scales exactly, at every
    scale value times the divisor, next to it on either side, and over float32's whole range."""
    from quantd.engine.qparams import _absmax_divisor

    sdt = getattr(torch, scale_dtype)
    values = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(sdt).float()
    values = values[torch.isfinite(values) & (values >= 0)]
    on = (values.double() * _absmax_divisor(dtype)).float()
    gen = torch.Generator().manual_seed(3)
    spread = torch.rand(50_000, generator=gen) * torch.exp2(torch.randint(-149, 128, (50_000,), generator=gen).float())
    absmax = torch.cat([on, torch.nextafter(on, torch.tensor(torch.inf)), torch.nextafter(on, torch.tensor(0.0)),
                        spread, torch.tensor([0.0, 1e-45, 3.4e38, torch.inf, torch.nan])])
    for lo, hi in ((-absmax, torch.zeros_like(absmax)), (torch.zeros_like(absmax), absmax), (-absmax, absmax / 2)):
        fast, zp = choose_qparams(lo, hi, dtype=dtype, symmetric=True, scale_dtype=scale_dtype)
        slow, _ = choose_qparams(lo.double(), hi.double(), dtype=dtype, symmetric=True, scale_dtype=scale_dtype)
        assert zp is None and fast.dtype == slow.dtype == sdt
        assert torch.equal(fast.float().nan_to_num(nan=-1.0), slow.float().nan_to_num(nan=-1.0))


def test_eager_callers_are_unaffected_by_a_compile_in_another_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.compiler.is_compiling()`` is process-wide: while any thread compiles (the servers' warm-up), it
    is true in every thread. Eager quantization (small tensors, and the GGUF searches' sums) must neither fail
    nor change then: the same codes, scales and GGUF bytes as without it."""
    from quantd.engine.ggml import ggml_type
    from quantd.engine.ggml import quantize as quantize_ggml
    from quantd.engine.primitives import quantize

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(32, 64, generator=gen)
    rows = torch.randn(4, 256, generator=gen)
    scheme = Scheme(dtype="int4", symmetric=False, granularity="group", group_size=32)
    before = quantize(w, scheme, name="w")
    q4_k = ggml_type("q4_k")
    ggml_before = quantize_ggml(rows, q4_k).data
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    assert torch.compiler.is_compiling()  # what another thread's compile makes every thread see
    during = quantize(w, scheme, name="w")
    assert torch.equal(during.codes, before.codes) and torch.equal(during.scale, before.scale)
    assert during.zero_point is not None and before.zero_point is not None
    assert torch.equal(during.zero_point, before.zero_point)
    assert torch.equal(quantize_ggml(rows, q4_k).data, ggml_before)


def test_tracing_a_kernel_that_leaves_the_divisor_to_choose_qparams_fails() -> None:
    """A compiled function must pass ``divisor_tensor`` in: made while tracing, the divisor would be a constant
    of the graph (which CUDA kernels multiply by the reciprocal of)."""
    from quantd.engine.qparams import choose_qparams, divisor_tensor

    lo, hi = -torch.rand(8), torch.rand(8)

    def passes(lo: torch.Tensor, hi: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return choose_qparams(lo, hi, dtype="int4", symmetric=True, scale_dtype="float32", divisor=d)[0]

    def leaves(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        return choose_qparams(lo, hi, dtype="int4", symmetric=True, scale_dtype="float32")[0]

    d = divisor_tensor("int4", True, lo.device)
    assert torch.equal(torch.compile(passes, backend="eager", fullgraph=True)(lo, hi, d), leaves(lo, hi))
    with pytest.raises(Exception, match="divisor"):
        torch.compile(leaves, backend="eager", fullgraph=True)(lo, hi)
