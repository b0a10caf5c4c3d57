"""quantize/dequantize against a slow, obviously-correct reference quantizer: Python loops over blocks and elements, tiny tensors only.

It follows docs/architecture.md literally: block view, range including 0, scale from the formula in
float64 rounded UP to the scale dtype (never below the exact value), codes per element.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from quantd.engine import primitives
from quantd.engine.primitives import dequantize, fake_quantize, quantize
from quantd.errors import ConfigError, NonFiniteError
from quantd_client import Scheme
from quantd_client._dtypes import DTYPES, NF4_CODEBOOK

SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def ref_blocks(x: np.ndarray, scheme: Scheme) -> np.ndarray:
    if scheme.granularity == "tensor":
        return x.reshape(1, -1)
    if scheme.granularity == "group" and x.ndim <= 1:
        return x.reshape(1, -1).reshape(-1, scheme.group_size)
    rows = np.moveaxis(x, scheme.axis, 0).reshape(x.shape[scheme.axis], -1)
    return rows if scheme.granularity == "channel" else rows.reshape(-1, scheme.group_size)


def ref_unblock(b: np.ndarray, shape: tuple[int, ...], scheme: Scheme) -> np.ndarray:
    if scheme.granularity == "tensor" or (scheme.granularity == "group" and len(shape) <= 1):
        return b.reshape(shape)
    axis = scheme.axis % len(shape)
    moved = (shape[axis], *shape[:axis], *shape[axis + 1:])
    return np.moveaxis(b.reshape(moved), 0, axis)


def round_up(s: float, scale_dtype: str) -> float:
    """Smallest value of the scale dtype ≥ s (one scalar at a time, by stepping bit patterns)."""
    dt = SCALE_DTYPES[scale_dtype]
    finfo = torch.finfo(dt)
    r = float(torch.tensor(s, dtype=torch.float64).to(dt).item())
    if r < s:
        bits = torch.tensor(r, dtype=dt).view(torch.int16 if dt != torch.float32 else torch.int32)
        r = float((bits + 1).view(dt).item())
    tiny = float(torch.ones((), dtype=torch.int16 if dt != torch.float32 else torch.int32).view(dt).item())
    return min(max(r, tiny), finfo.max)


def ref_quantize(x: torch.Tensor, scheme: Scheme) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(codes in x's shape, scale per block, zero point per block or None)."""
    info = DTYPES[scheme.dtype]
    xf = x.float().numpy()
    blocks = ref_blocks(xf, scheme)
    codes = np.zeros(blocks.shape, dtype=np.float64)
    scales = np.zeros(blocks.shape[0])
    zps = np.zeros(blocks.shape[0], dtype=np.int64)
    for b in range(blocks.shape[0]):
        row = blocks[b]
        lo, hi = min(float(row.min()), 0.0), max(float(row.max()), 0.0)
        absmax = max(-lo, hi)
        if info.kind == "nf4":
            s = round_up(absmax, scheme.scale_dtype)
        elif info.kind == "fp8":
            s = round_up(absmax / info.max_finite, scheme.scale_dtype)
        elif scheme.symmetric:
            s = round_up(absmax / ((info.qmax - info.qmin) / 2), scheme.scale_dtype)
        else:
            s = round_up((hi - lo) / (info.qmax - info.qmin), scheme.scale_dtype)
            zps[b] = min(max(round(info.qmin - lo / s), info.qmin), info.qmax)
        scales[b] = s
        for k, v in enumerate(row):
            q = float(np.float32(v) / np.float32(s))  # the division in float32, as the engine does
            if info.kind == "int":
                codes[b, k] = min(max(round(q) + zps[b], info.qmin), info.qmax)  # round(): half to even
            elif info.kind == "nf4":
                codes[b, k] = int(np.argmin([abs(q - c) for c in NF4_CODEBOOK]))
            else:
                q = min(max(q, -info.max_finite), info.max_finite)
                codes[b, k] = float(torch.tensor(q, dtype=torch.float32).to(FP8[scheme.dtype]).float())
    zp = None if (scheme.symmetric or info.kind != "int") else zps
    return ref_unblock(codes, tuple(x.shape), scheme), scales, zp


def ref_dequantize(codes: np.ndarray, scales: np.ndarray, zps: np.ndarray | None, scheme: Scheme,
                   shape: tuple[int, ...]) -> np.ndarray:
    info = DTYPES[scheme.dtype]
    blocks = ref_blocks(codes, scheme)
    out = np.zeros(blocks.shape)
    for b in range(blocks.shape[0]):
        for k, c in enumerate(blocks[b]):
            if info.kind == "nf4":
                out[b, k] = NF4_CODEBOOK[int(c)] * scales[b]
            else:
                out[b, k] = (c - (zps[b] if zps is not None else 0)) * scales[b]
    return ref_unblock(out, shape, scheme)


# ------------------------------------------------------------------------------------------- tests


QUANT_DTYPES = ["int8", "int4", "int3", "int2", "uint8", "uint4", "nf4", "fp8_e4m3", "fp8_e5m2"]
# (shape, granularity, axis, group_size)
LAYOUTS = [
    ((6, 32), "tensor", 0, 128),
    ((6, 32), "channel", 0, 128),
    ((6, 32), "channel", 1, 128),
    ((6, 32), "group", 0, 8),
    ((4, 3, 2, 4), "channel", 0, 128),  # conv weight [out, in, kh, kw]
    ((4, 3, 2, 4), "channel", -1, 128),
    ((4, 3, 2, 4), "group", 0, 12),
    ((4, 3, 2, 4), "group", 1, 16),
    ((3, 5, 4), "group", -1, 5),
    ((48,), "group", 0, 16),
    ((48,), "channel", 0, 128),
]


def _scheme(dtype: str, gran: str, axis: int, gs: int, **kw: object) -> Scheme:
    return Scheme.model_validate({"dtype": dtype, "granularity": gran, "axis": axis, "group_size": gs, **kw})


def _check_against_reference(x: torch.Tensor, scheme: Scheme) -> None:
    qt = quantize(x, scheme, name="w")
    codes, scales, zps = ref_quantize(x, scheme)
    assert qt.codes.shape == x.shape
    np.testing.assert_array_equal(qt.codes.float().numpy(), codes)
    assert qt.scale is not None
    np.testing.assert_array_equal(qt.scale.double().reshape(-1).numpy(), scales)
    if zps is None:
        assert qt.zero_point is None
    else:
        assert qt.zero_point is not None and qt.zero_point.shape == qt.scale.shape
        np.testing.assert_array_equal(qt.zero_point.reshape(-1).numpy().astype(np.int64), zps)
    if DTYPES[scheme.dtype].kind != "fp8":
        x_hat = dequantize(qt).double().numpy()
        np.testing.assert_allclose(x_hat, ref_dequantize(codes, scales, zps, scheme, tuple(x.shape)),
                                   rtol=1e-6, atol=1e-12)


# Every (dtype, symmetric) pair a Scheme accepts: unsigned needs a zero point, nf4/fp8 have none.
DTYPE_SYMMETRIC = [(d, s) for d in QUANT_DTYPES for s in (True, False)
                   if (DTYPES[d].kind == "int" and (DTYPES[d].signed or not s)) or (DTYPES[d].kind != "int" and s)]


@pytest.mark.parametrize("dtype,symmetric", DTYPE_SYMMETRIC)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: f"{t[0]}-{t[1]}{t[2]}-g{t[3]}")
def test_matches_reference(dtype: str, symmetric: bool, layout: tuple) -> None:
    shape, gran, axis, gs = layout
    g = torch.Generator().manual_seed(hash((dtype, shape, gran, axis)) % 2**31)
    x = torch.randn(shape, generator=g) * torch.linspace(0.1, 3.0, shape[0]).reshape(-1, *([1] * (len(shape) - 1)))
    x += 0.3  # off-centre, so affine zero points are not trivial
    _check_against_reference(x, _scheme(dtype, gran, axis, gs, symmetric=symmetric))


@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("dtype", ["int8", "int4", "uint4", "nf4", "fp8_e4m3"])
def test_scale_dtypes_match_reference(scale_dtype: str, dtype: str) -> None:
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(1)) * 7
    _check_against_reference(x, _scheme(dtype, "group", 0, 8, scale_dtype=scale_dtype))
    qt = quantize(x, _scheme(dtype, "group", 0, 8, scale_dtype=scale_dtype))
    assert qt.scale is not None and qt.scale.dtype == SCALE_DTYPES[scale_dtype]


@pytest.mark.parametrize("dtype", ["int8", "int4", "uint8", "nf4", "fp8_e5m2"])
@pytest.mark.parametrize("gran", ["tensor", "channel", "group"])
def test_chunked_path_equals_reference(monkeypatch: pytest.MonkeyPatch, dtype: str, gran: str) -> None:
    """Tiny chunks force many row chunks and, for long rows, column chunks."""
    monkeypatch.setattr(primitives, "CHUNK_ELEMENTS", 16)
    x = torch.randn(7, 40, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    _check_against_reference(x, _scheme(dtype, gran, 0, 8))


@pytest.mark.parametrize("in_dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_and_high_precision_inputs(in_dtype: torch.dtype) -> None:
    x = (torch.randn(8, 16, generator=torch.Generator().manual_seed(3)) * 2).to(in_dtype)
    scheme = _scheme("int4", "group", 0, 8)
    _check_against_reference(x, scheme)
    qt = quantize(x, scheme)
    assert qt.orig_dtype == in_dtype
    y = fake_quantize(x, scheme)
    assert y.dtype == in_dtype and y.shape == x.shape


@pytest.mark.parametrize("dtype", [*QUANT_DTYPES, "float16", "bfloat16"])
@pytest.mark.parametrize("gran", ["tensor", "channel", "group"])
def test_zero_tensor_is_exact(dtype: str, gran: str) -> None:
    x = torch.zeros(4, 32)
    qt = quantize(x, _scheme(dtype, gran, 0, 16))
    assert torch.equal(dequantize(qt), x)


def test_zero_block_among_others_is_exact() -> None:
    x = torch.randn(4, 32)
    x[1] = 0
    x_hat = fake_quantize(x, _scheme("int4", "group", 0, 16))
    assert torch.equal(x_hat[1], torch.zeros(32))


@pytest.mark.parametrize("dtype,torch_dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_float_casts(dtype: str, torch_dtype: torch.dtype) -> None:
    x = torch.tensor([[1.0, -2.5, 1e-3, 1e6], [0.0, 3.0, -1e9, 7.0]])
    qt = quantize(x, _scheme(dtype, "group", 0, 128))
    assert qt.codes.dtype == torch_dtype and qt.scale is None and qt.zero_point is None
    finfo = torch.finfo(torch_dtype)
    expected = x.clamp(finfo.min, finfo.max).to(torch_dtype)  # saturating: never inf
    assert torch.equal(qt.codes, expected)
    assert torch.isfinite(dequantize(qt)).all()


@pytest.mark.parametrize("in_dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("dtype,torch_dtype", [("float16", torch.float16), ("bfloat16", torch.bfloat16)])
def test_float_casts_from_every_input_dtype(dtype: str, torch_dtype: torch.dtype, in_dtype: torch.dtype) -> None:
    # float16 cannot hold bfloat16's bounds (the clamp overflowed), and bfloat16 holds float16's 65504 as 65536
    # (the clamp let inf through): the saturating cast must not depend on the input dtype.
    big = float(torch.finfo(in_dtype).max)
    over = min(7e4, big)  # beyond float16's range where the input holds it
    x = torch.tensor([[1.0, -2.5, over, -big], [big, 65504.0, -over, 0.0]], dtype=torch.float64).to(in_dtype)
    qt = quantize(x, _scheme(dtype, "group", 0, 128))
    finfo = torch.finfo(torch_dtype)
    assert torch.equal(qt.codes, x.double().clamp(finfo.min, finfo.max).to(torch_dtype))
    assert torch.isfinite(qt.codes).all()


@pytest.mark.parametrize("dtype,torch_dtype,np_dtype", [("float16", torch.float16, np.float16),
                                                       ("bfloat16", torch.bfloat16, None)])
def test_float64_casts_round_once(dtype: str, torch_dtype: torch.dtype, np_dtype: type | None) -> None:
    # torch's float64 → float16/bfloat16 goes through float32 and rounds twice: 1 + 2⁻¹¹ + 2⁻⁴⁰ became 1.0
    mant = 10 if torch_dtype == torch.float16 else 7
    half_ulp = 2.0 ** -(mant + 1)
    g = torch.Generator().manual_seed(4)
    x = torch.cat([torch.tensor([1 + half_ulp + 2**-40, -(1 + half_ulp + 2**-40), 1 + half_ulp, 1 + 3 * half_ulp,
                                 1 + half_ulp - 2**-40, 2**-20 * (1 + 2**-30), 0.0], dtype=torch.float64),
                   torch.randn(4000, generator=g, dtype=torch.float64) * 100])
    got = quantize(x.reshape(1, -1), _scheme(dtype, "group", 0, 128)).codes.reshape(-1)
    assert got[0] == 1 + 2 * half_ulp and got[1] == -(1 + 2 * half_ulp)  # above the tie: up, not to 1.0
    assert got[2] == 1.0 and got[3] == 1 + 4 * half_ulp and got[4] == 1.0  # ties to even; below the tie: down
    if np_dtype is not None:  # numpy rounds float64 → float16 once
        np.testing.assert_array_equal(got.numpy(), x.numpy().astype(np_dtype))
    else:  # each value is the nearer of its two bfloat16 neighbours
        lo = got.double()
        nxt = torch.nextafter(got, torch.where(x > lo, torch.inf, -torch.inf).to(torch_dtype)).double()
        assert bool(((x - lo).abs() <= (x - nxt).abs()).all())


def test_clipping_of_a_float16_cast_is_counted_for_bfloat16_inputs() -> None:
    # compared in bfloat16, float16's largest value 65504 is 65536: 65536 must still count as clipped
    from quantd.engine.stats import clipped_count

    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        x = torch.tensor([[65536.0, 1.0, -2.0, -65536.0]], dtype=dtype)
        assert clipped_count(x, quantize(x, _scheme("float16", "group", 0, 128))) == 2


@pytest.mark.parametrize("dtype,gran", [("int4", "group"), ("int8", "channel"), ("nf4", "group"),
                                        ("fp8_e4m3", "channel"), ("uint4", "tensor")])
def test_a_scale_beyond_the_scale_dtype_is_a_config_error(dtype: str, gran: str) -> None:
    # a scale beyond float16's range is a ConfigError, not a clamp that clips the whole block
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(6))
    x[3] *= 1e12
    with pytest.raises(ConfigError, match=r"field 'scale_dtype' tensor 'w': a scale of .* is needed, beyond "
                                          r"float16's largest value 65504: use scale_dtype bfloat16 or float32"):
        quantize(x, _scheme(dtype, gran, 0, 32), name="w")
    for wide in ("bfloat16", "float32"):
        qt = quantize(x, _scheme(dtype, gran, 0, 32, scale_dtype=wide), name="w")
        assert bool(torch.isfinite(dequantize(qt)).all())
    big = torch.full((2, 32), 1e300, dtype=torch.float64)  # finite, but not in float32: said so, not "NaN or Inf"
    with pytest.raises(ConfigError, match=r"values up to 1e\+300 are beyond float32's range"):
        quantize(big, _scheme("int8", "channel", 0, 32, scale_dtype="float32"), name="w")
    assert float(quantize(big, _scheme("float16", "channel", 0, 32), name="w").codes.max()) == 65504.0
    edge = torch.zeros(2, 32)
    edge[0, 0] = 65504.0 * 127.5  # a scale of exactly float16's largest value still fits
    quantize(edge, _scheme("int8", "channel", 0, 32, symmetric=True), name="w")


def test_fp8_saturates_instead_of_nan() -> None:
    x = torch.randn(4, 16)
    lo, hi = torch.full((4,), -0.1), torch.full((4,), 0.1)  # a range far narrower than the data
    qt = quantize(x, _scheme("fp8_e4m3", "channel", 0, 128), observer_range=(lo, hi))
    assert torch.isfinite(qt.codes.float()).all()
    assert float(qt.codes.float().abs().max()) == 448.0


def test_explicit_observer_range_is_used() -> None:
    x = torch.linspace(-1, 1, 32).reshape(2, 16)
    scheme = _scheme("int8", "channel", 0, 128, symmetric=True)
    qt = quantize(x, scheme, observer_range=(torch.tensor([-0.5, -0.5]), torch.tensor([0.5, 0.5])))
    assert qt.scale is not None
    assert torch.all(qt.scale.float() >= 0.5 / 127.5) and torch.all(qt.scale.float() < 0.5 / 127.5 * 1.001)
    assert int(qt.codes.max()) == 127 and int(qt.codes.min()) == -128  # clipped


def test_observer_range_of_wrong_size_names_field() -> None:
    with pytest.raises(ConfigError, match="observer_range") as e:
        quantize(torch.randn(4, 8), _scheme("int8", "channel", 0, 128),
                 name="layer.w", observer_range=(torch.zeros(3), torch.ones(3)))
    assert e.value.tensor == "layer.w"


@pytest.mark.parametrize("x,scheme,field", [
    (torch.randn(4, 30), _scheme("int4", "group", 0, 128), "group_size"),
    (torch.randn(4, 30), _scheme("int4", "channel", 2, 128), "axis"),
    (torch.randn(4, 30), _scheme("int4", "channel", -3, 128), "axis"),
    (torch.tensor(1.5), _scheme("int8", "channel", 0, 128), "axis"),
    (torch.zeros(0, 8), _scheme("int8", "tensor", 0, 128), "shape"),
    (torch.zeros(4, 8, dtype=torch.int32), _scheme("int8", "tensor", 0, 128), "dtype"),
])
def test_impossible_configs_name_field_and_tensor(x: torch.Tensor, scheme: Scheme, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        quantize(x, scheme, name="model.layers.0.mlp.w")
    assert e.value.field == field and e.value.tensor == "model.layers.0.mlp.w"
    assert field in str(e.value) and "model.layers.0.mlp.w" in str(e.value)


def test_zero_dim_tensor_per_tensor() -> None:
    qt = quantize(torch.tensor(-2.0), _scheme("int8", "tensor", 0, 128, symmetric=True))
    assert qt.codes.shape == () and abs(float(dequantize(qt)) + 2.0) <= float(qt.scale) / 2  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", ["int4", "float16"])
def test_non_finite_weights_raise(bad: float, dtype: str) -> None:
    x = torch.randn(4, 16)
    x[2, 3] = bad
    with pytest.raises(NonFiniteError) as e:
        quantize(x, _scheme(dtype, "group", 0, 16), name="w.bad")
    assert e.value.tensor == "w.bad"


def test_codes_of_non_contiguous_input_follow_logical_layout() -> None:
    x = torch.randn(16, 8).t()  # [8, 16], non-contiguous
    scheme = _scheme("int4", "group", 0, 8)
    assert torch.equal(quantize(x, scheme).codes, quantize(x.contiguous(), scheme).codes)


@pytest.mark.parametrize("path", ["eager", "compiled"])
@pytest.mark.parametrize("scale_dtype", ["float32", "float16"])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_half_step_ties_at_the_range_ends_are_clamped_not_wrapped(request: pytest.FixtureRequest, path: str,
                                                                  scale_dtype: str, in_dtype: torch.dtype,
                                                                  dtype: str) -> None:
    # amax / scale == qmax + ½ exactly (scale 1.0 is exact): round-half-even gives qmax + 1, which the
    # fused integer store must clamp (not wrap around to qmin); the low end −qmax − ½ → qmin − 0 stays
    # in range (the compiled symmetric min-max kernel clamps only the top, from that bound).
    request.getfixturevalue(path)
    info = DTYPES[dtype]
    half = (info.qmax - info.qmin) / 2
    row = torch.tensor([[half, -half, 0.5, 1.5, -2.5, 2.5]])
    x = torch.cat([row, row * 2.0], dim=0).to(in_dtype)
    scheme = Scheme(dtype=dtype, symmetric=True, granularity="channel", scale_dtype=scale_dtype)
    from quantd.engine import kernels

    kernels.KERNELS._warm.clear()
    qt = quantize(x, scheme)
    assert ("minmax" in {key[0] for key in kernels.KERNELS._warm}) == (path == "compiled")  # the one-call kernel
    assert qt.scale is not None and qt.scale.tolist() == [1.0, 2.0]
    expected = torch.round(x / qt.scale.unsqueeze(1)).clamp(info.qmin, info.qmax)
    assert torch.equal(qt.codes.to(torch.int32), expected.to(torch.int32))
    assert qt.codes[0, 0] == info.qmax and qt.codes[0, 2] == 0 and qt.codes[0, 4] == -2


# ------------------------------------------------------------------ the compiled kernels (quantd.engine.kernels)

COMPILED_LAYOUTS = [LAYOUTS[1], LAYOUTS[2], LAYOUTS[7]]  # rows, a strided view, groups on a moved axis


@pytest.mark.parametrize("dtype,symmetric", DTYPE_SYMMETRIC)
@pytest.mark.parametrize("layout", COMPILED_LAYOUTS, ids=lambda t: f"{t[0]}-{t[1]}{t[2]}-g{t[3]}")
def test_compiled_kernels_match_reference(compiled: None, dtype: str, symmetric: bool, layout: tuple) -> None:
    shape, gran, axis, gs = layout
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(11)) * 3
    _check_against_reference(x, _scheme(dtype, gran, axis, gs, symmetric=symmetric))


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_all_finite_flag(bad: float | None) -> None:
    """The kernels' finite check: exact for values near float32's limit (whose plain sum overflows) and for
    one NaN or Inf among thousands, in either tensor."""
    from quantd.engine.kernels.quantize import all_finite

    lo = torch.full((5000,), -3.0e38)
    hi = torch.full((5000,), 3.0e38)
    if bad is None:
        assert bool(all_finite(lo, hi))
        return
    for t in (lo, hi):
        t[1234] = bad
        assert not bool(all_finite(lo, hi))
        t[1234] = 0.0


@pytest.mark.parametrize("dtype,symmetric", DTYPE_SYMMETRIC)
@pytest.mark.parametrize("layout", COMPILED_LAYOUTS, ids=lambda t: f"{t[0]}-{t[1]}{t[2]}-g{t[3]}")
def test_compiled_dequantize_equals_eager(compiled: None, dtype: str, symmetric: bool, layout: tuple) -> None:
    from quantd.engine import kernels

    shape, gran, axis, gs = layout
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(13)) * 3
    qt = quantize(x, _scheme(dtype, gran, axis, gs, symmetric=symmetric))
    got = dequantize(qt)
    kernels.KERNELS.reset(available=False)
    want = dequantize(qt)
    kernels.KERNELS.reset(available=True)
    assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("observer", ["minmax", "percentile"])
def test_compiled_kernels_low_precision_inputs_and_observers(compiled: None, in_dtype: torch.dtype,
                                                               observer: str) -> None:
    x = (torch.randn(8, 48, generator=torch.Generator().manual_seed(12)) * 2).to(in_dtype)
    for dtype in ("int4", "uint8", "nf4"):
        scheme = _scheme(dtype, "group", 0, 16, observer=observer)
        got = quantize(x, scheme)
        from quantd.engine import kernels

        kernels.KERNELS.reset(available=False)
        want = quantize(x, scheme)
        kernels.KERNELS.reset(available=True)
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scale, want.scale)


def test_compiled_nf4_codes_count_the_midpoints_below(compiled: None) -> None:
    """The compiled nf4 encode (a binary search) gives #{midpoints < v} at and next to every midpoint."""
    from quantd.engine import kernels
    from quantd.engine.primitives import NF4_CODEBOOK_F32, NF4_MIDPOINTS

    m = torch.tensor(NF4_MIDPOINTS)
    v = torch.cat([m, torch.nextafter(m, torch.tensor(2.0)), torch.nextafter(m, torch.tensor(-2.0)), NF4_CODEBOOK_F32,
                   torch.tensor([-5.0, -1.0, -0.0, 0.0, 1.0, 5.0, float("nan")]), torch.linspace(-1.1, 1.1, 4001)])
    got = kernels.quantize.encode_nf4(v.reshape(1, -1), torch.ones(1, 1), NF4_MIDPOINTS)
    assert got is not None and got.dtype == torch.uint8
    assert torch.equal(got.reshape(-1), (v.unsqueeze(1) > m).sum(1).to(torch.uint8))


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("compile_it", [False, True])
def test_fp8_rounding_in_arithmetic_is_the_float8_cast(dtype: str, compile_it: bool) -> None:
    """The mse search's fp8 rounding (exponent bits → step, ``round(v / step) · step``) gives the float8
    cast's value at every fp8 value, at every midpoint between two (ties to even), next to them, among
    the subnormals and at ±0, eager and compiled."""
    from quantd.engine import kernels

    f8 = kernels.quantize.FP8_TORCH_DTYPES[dtype]
    mant, emin = kernels.mse.fp8_format(dtype)
    top = torch.finfo(f8).max
    values = torch.arange(256, dtype=torch.uint8).view(f8).float()
    values = values[torch.isfinite(values)].sort().values
    mids = (values[1:] + values[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    v = torch.cat([values, mids, torch.nextafter(mids, up), torch.nextafter(mids, down),
                   torch.nextafter(values, up), torch.nextafter(values, down), torch.tensor([0.0, -0.0]),
                   torch.randn(20_000) * torch.logspace(emin - mant - 4, math.log2(top), 20_000, base=2)])
    v = v.clamp(-top, top)
    fn = kernels.mse._round_fp8
    if compile_it:
        fn = torch.compile(fn, dynamic=True, fullgraph=True, options=kernels.INDUCTOR_OPTIONS)
    with warnings.catch_warnings():  # the compiler's own deprecation warnings
        warnings.simplefilter("ignore")
        got = fn(v, mant, emin)
    want = v.to(f8).float()
    assert torch.equal(got, want), v[got != want][:8]
    assert torch.equal(torch.signbit(got[want == 0]), torch.signbit(v[want == 0]))


@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_ties_round_half_even_before_an_odd_zero_point(request: pytest.FixtureRequest, path: str) -> None:
    # uint8 affine over [-15, 240]: scale 1.0 exactly, zero point 15 (odd). round(x / s) + zp rounds the
    # ties of x / s (2.5 → 2 → 17); rounding x / s + zp instead would give 17.5 → 18.
    request.getfixturevalue(path)
    row = torch.tensor([-15.0, 240.0, 2.5, -3.5, 0.5, 1.5, -0.5, 100.5])
    x = torch.stack([row, row * 2.0])
    scheme = Scheme(dtype="uint8", symmetric=False, granularity="channel", scale_dtype="float32")
    qt = quantize(x, scheme)
    assert qt.scale is not None and qt.scale.tolist() == [1.0, 2.0]
    assert qt.zero_point is not None and qt.zero_point.tolist() == [15, 15]
    assert qt.codes[0].tolist() == [0, 255, 17, 11, 15, 17, 15, 115]
    _check_against_reference(x, scheme)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype,gran,observer", [("int8", "channel", "minmax"), ("int4", "group", "minmax"),
                                                 ("nf4", "group", "minmax"), ("int4", "group", "mse"),
                                                 ("fp8_e4m3", "channel", "percentile")])
def test_compiled_path_rejects_non_finite_weights(compiled: None, bad: float, dtype: str, gran: str,
                                                  observer: str) -> None:
    x = torch.randn(8, 32)
    x[3, 5] = bad
    with pytest.raises(NonFiniteError):
        quantize(x, _scheme(dtype, gran, 0, 16, observer=observer), name="w")


def test_a_compiler_failure_falls_back_to_eager(monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    from quantd.engine import kernels

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(kernels, "MIN_ELEMENTS", 0)
    fresh = kernels.KERNELS  # the process's switch, with nothing compiled yet and restored afterwards
    for attr, value in (("_fns", {}), ("_warm", set()), ("_broken", None), ("_available", True)):
        monkeypatch.setattr(fresh, attr, value)
    monkeypatch.setattr(torch, "compile", broken)
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(13))
    scheme = _scheme("int4", "group", 0, 8)
    _check_against_reference(x, scheme)
    assert fresh._broken is not None and "no C++ compiler" in fresh._broken
    assert not fresh.available() and "compiled kernels disabled" in caplog.text


def test_a_kernel_past_its_recompile_limit_runs_eager_alone(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Dynamo raises (fullgraph) once a kernel has RECOMPILE_LIMIT variants: that kernel goes eager, the
    others stay compiled."""
    from quantd.engine import kernels

    if not kernels.KERNELS.available():
        pytest.skip("no compiler")
    monkeypatch.setattr(kernels, "RECOMPILE_LIMIT", 1)
    fresh = kernels._Compiled()
    fresh.reset(available=True)

    def toy(x: torch.Tensor, tag: str) -> torch.Tensor:  # a new variant per tag
        return x + (1.0 if tag == "a" else 2.0)

    x = torch.ones(3)
    assert torch.equal(fresh.call("toy", toy, ("a",), x, "a"), x + 1)
    assert fresh.call("toy", toy, ("b",), x, "b") is None  # a second variant: past the limit of 1
    assert fresh._broken is None and fresh.available() and "runs eager from now on" in caplog.text
    assert fresh.call("toy", toy, ("a",), x, "a") is None
    assert torch.equal(fresh.call("other", lambda v: v * 3.0, (), x), x * 3)


def test_a_view_compiles_once_whatever_its_base_and_keeps_its_static_dims() -> None:
    """A kernel called on views of one shape cut from bases of other sizes (a file buffer, a 2-D tensor)
    compiles once (Dynamo would guard on the bases' sizes), and a dim marked static on a view stays static (a
    new width is a new variant)."""
    from torch._dynamo.utils import counters

    from quantd.engine import kernels

    if not kernels.KERNELS.available():
        pytest.skip("no compiler")
    fresh = kernels._Compiled()
    fresh.reset(available=True)

    def two(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.sum(1) + y.sum(1)

    def graphs_after(x: torch.Tensor, y: torch.Tensor) -> int:
        torch._dynamo.mark_static(x, 1)
        torch._dynamo.mark_static(y, 1)
        assert torch.equal(fresh.call("two", two, (), x, y), x.sum(1) + y.sum(1))
        return int(counters["stats"]["unique_graphs"])

    first = graphs_after(torch.arange(48.0).view(6, 8), torch.arange(48.0).view(6, 8))  # bases of one size
    assert graphs_after(torch.arange(80.0).view(10, 8), torch.arange(80.0).view(10, 8)) == first  # dynamic length
    assert graphs_after(torch.arange(48.0).view(6, 8), torch.arange(96.0)[:48].view(6, 8)) == first  # other bases
    assert graphs_after(torch.ones(7, 10)[1:], torch.ones(7, 10)[1:]) == first + 1  # a static dim changed


def test_recompile_limit_raised_per_thread_for_a_kernel_call() -> None:
    """Each kernel call raises Dynamo's recompile limit for its own thread and restores it on leaving, whatever
    order overlapping calls of other threads leave in."""
    import threading

    from quantd.engine import kernels

    config = torch._dynamo.config
    before = config.recompile_limit
    entered, release = threading.Barrier(2), threading.Event()
    seen: list[int] = []

    def first() -> None:
        with kernels._recompile_limit():
            entered.wait()
            seen.append(config.recompile_limit)
            release.wait()
        seen.append(config.recompile_limit)

    worker = threading.Thread(target=first)
    worker.start()
    with kernels._recompile_limit():
        entered.wait()
        release.set()
        worker.join()  # the other call has left: this one still runs with the raised limit
        seen.append(config.recompile_limit)
    assert seen == [kernels.RECOMPILE_LIMIT, before, kernels.RECOMPILE_LIMIT]
    assert config.recompile_limit == before


def test_kernels_only_for_large_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    from quantd.engine import kernels

    fresh = kernels._Compiled()
    monkeypatch.setenv("QUANTD_COMPILE", "1")
    assert fresh.wants(torch.empty(kernels.MIN_ELEMENTS)) == fresh.available()
    assert not fresh.wants(torch.empty(kernels.MIN_ELEMENTS - 1))
    monkeypatch.setenv("QUANTD_COMPILE", "0")
    fresh.reset()
    assert not fresh.available() and not fresh.wants(torch.empty(kernels.MIN_ELEMENTS))


_SMALL_FIRST_PROBE = r"""
import torch
torch.set_num_threads(2)
from quantd.engine import kernels
tiny = torch.randn(8, 64).to(torch.bfloat16)  # a kernel's first call on a tiny tensor (tests do that)
assert kernels.quantize.row_range(tiny) is not None
"""


@pytest.mark.slow
@pytest.mark.skipif(not __import__("shutil").which("c++"), reason="needs a C++ compiler for the compiled kernels")
def test_kernels_first_compiled_on_a_tiny_tensor_still_run_in_parallel(tmp_path: Path) -> None:
    """Inductor decides serial vs parallel from the sizes of a kernel's first call; with dynamic shapes that
    kernel then serves every size (and other processes, through its disk cache). The kernels are built with
    an OpenMP loop whatever the first size, so a large tensor later runs on every thread."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "QUANTD_COMPILE": "1",
           "TORCH_LOGS": "output_code"}
    out = subprocess.run([sys.executable, "-c", _SMALL_FIRST_PROBE], capture_output=True, text=True, env=env,
                         timeout=600, check=True)
    code = out.stdout + out.stderr
    assert 'extern "C"' in code, code[-3000:]
    assert "omp parallel" in code, code[-3000:]


@pytest.mark.parametrize("dtype,symmetric", [("int8", True), ("int4", False), ("uint4", False), ("nf4", True)])
def test_minmax_schemes_take_the_one_call_kernel(compiled: None, monkeypatch: pytest.MonkeyPatch,
                                                 dtype: str, symmetric: bool) -> None:
    from quantd.engine import kernels

    calls: list[int] = []
    real = kernels.quantize.quantize_minmax
    monkeypatch.setattr(kernels.quantize, "quantize_minmax", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(19)) * 3
    x[0] = 0.0  # an all-zero row: the smallest scale, exact zeros
    for gran in ("channel", "group"):
        _check_against_reference(x, _scheme(dtype, gran, 0, 16, symmetric=symmetric))
    assert len(calls) == 2
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[1, 1] = bad
        with pytest.raises(NonFiniteError):
            quantize(y, _scheme(dtype, "group", 0, 16, symmetric=symmetric), name="w")


def test_kernels_work_with_older_torch_names_for_the_recompile_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch names the limit ``cache_size_limit`` and its error ``FailOnCacheLimitHit`` (releases before
    the rename), a kernel call sets that limit and restores it, a kernel past it runs eager alone, and any other
    failure falls back to eager: nothing escapes to the job."""
    import types

    from quantd.engine import kernels

    class FailOnCacheLimitHit(Exception):
        pass

    config = types.SimpleNamespace(cache_size_limit=8)
    monkeypatch.setattr(torch._dynamo, "config", config)
    monkeypatch.setattr(torch._dynamo, "exc", types.SimpleNamespace(FailOnCacheLimitHit=FailOnCacheLimitHit))
    kernels._limit_names.cache_clear()
    try:
        seen: list[int] = []

        def compiled(error: type[Exception]) -> Callable[..., Any]:
            def run(x: torch.Tensor) -> torch.Tensor:
                seen.append(config.cache_size_limit)
                raise error("raised by the compiled call")
            return run

        fresh = kernels._Compiled()
        fresh.reset(available=True)
        monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled(FailOnCacheLimitHit))
        assert fresh.call("past_limit", lambda x: x, (), torch.ones(3)) is None
        assert seen == [kernels.RECOMPILE_LIMIT] and config.cache_size_limit == 8
        assert "past_limit" in fresh._exhausted and fresh.available()
        monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled(RuntimeError))
        assert fresh.call("other", lambda x: x, (), torch.ones(3)) is None
        assert fresh._broken is not None and "RuntimeError" in fresh._broken and config.cache_size_limit == 8
    finally:
        kernels._limit_names.cache_clear()
