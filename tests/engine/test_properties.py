"""Hypothesis properties of the quantizer: error bounds and orderings that must hold for any input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from quantd.engine.primitives import dequantize, fake_quantize, quantize
from quantd.engine.stats import error_stats
from quantd_client import Scheme

FAST = settings(max_examples=40, deadline=None)
finite = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)


def _scheme(**kw: object) -> Scheme:
    return Scheme.model_validate(kw)


def _mse(x: torch.Tensor, scheme: Scheme) -> float:
    return float(((x.double() - fake_quantize(x, scheme).double()) ** 2).mean())


def _mean_row_relative_mse(x: torch.Tensor, scheme: Scheme, row: int | None = None) -> float:
    """Mean over rows (of ``row`` elements; default: the last dim) of MSE / signal power: every row
    counts, not only the loudest one."""
    row = row or x.shape[-1]
    xd = x.double().reshape(-1, row)
    err = ((xd - fake_quantize(x, scheme).double().reshape(-1, row)) ** 2).mean(dim=1)
    return float((err / (xd**2).mean(dim=1)).mean())


@FAST
@given(x=arrays(np.float32, st.tuples(st.integers(1, 6), st.sampled_from([8, 16, 24])), elements=finite),
       dtype=st.sampled_from(["int8", "int4", "int3", "int2"]),
       gran=st.sampled_from(["tensor", "channel", "group"]),
       scale_dtype=st.sampled_from(["float16", "bfloat16", "float32"]))
def test_symmetric_minmax_error_within_half_step(x: np.ndarray, dtype: str, gran: str, scale_dtype: str) -> None:
    t = torch.from_numpy(x)
    scheme = _scheme(dtype=dtype, granularity=gran, group_size=8, symmetric=True, scale_dtype=scale_dtype)
    qt = quantize(t, scheme)
    assert qt.scale is not None
    s = qt.scale.float()
    step = s if gran == "tensor" else (s.unsqueeze(1) if gran == "channel" else s.repeat_interleave(8, dim=1))
    err = (t - dequantize(qt)).abs()
    st_ = error_stats(t, dequantize(qt), qt)
    assert st_.clipped_fraction == 0.0  # min-max: nothing is outside the range
    # Every element (none clipped) is within half its own step, up to float32 rounding of x̂.
    assert torch.all(err <= step / 2 + 1e-6 * t.abs().max() + 1e-30)
    tol = 1e-6 * float(t.abs().max()) + 1e-30  # x̂ is float32: its rounding is relative to |x|
    assert st_.max_abs_error <= st_.theoretical_max_error + tol  # type: ignore[operator]


@FAST
@given(x=arrays(np.float32, st.integers(2, 128), elements=finite))
def test_eight_bits_never_worse_than_four(x: np.ndarray) -> None:
    # With ≤ 225 elements this is guaranteed: the int4 error at the absmax is ≈ absmax/15, while
    # every int8 error is ≤ absmax/255.
    t = torch.from_numpy(x)
    assert _mse(t, _scheme(dtype="int8", granularity="tensor", symmetric=True)) <= \
        _mse(t, _scheme(dtype="int4", granularity="tensor", symmetric=True))


rows_of_scales = st.lists(st.integers(0, 3), min_size=2, max_size=4, unique=True)
unit_rows = arrays(np.float32, (4, 32), elements=st.floats(-1, 1, width=32))


def _with_peak(base: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(base.copy())
    t[..., 0] = 1.0  # every row/group has an element of magnitude 1, so its range is ≥ 1
    return t


@FAST
@given(base=unit_rows, exps=rows_of_scales, dtype=st.sampled_from(["int8", "int4", "uint4"]))
def test_per_channel_beats_per_tensor_on_rows_of_different_scales(base: np.ndarray, exps: list[int],
                                                                  dtype: str) -> None:
    t = _with_peak(base)[: len(exps)] * torch.tensor([100.0**e for e in exps]).unsqueeze(1)
    # float32 scales: a float16 scale would saturate at 65504 for the 1e6 rows and clip both alike.
    kw = {"dtype": dtype, "scale_dtype": "float32"}
    # Not plain MSE: it is dominated by the loudest row, whose grid is nearly the same under both schemes,
    # so which one wins there is rounding luck (hypothesis found such a case). The quiet rows are what
    # per-channel scales are for: their relative error drops by orders of magnitude.
    channel = _mean_row_relative_mse(t, _scheme(granularity="channel", **kw))
    tensor = _mean_row_relative_mse(t, _scheme(granularity="tensor", **kw))
    assert channel < tensor


@FAST
@given(base=unit_rows, exps=st.lists(st.integers(0, 3), min_size=4, max_size=4, unique=True),
       dtype=st.sampled_from(["int8", "int4", "nf4"]))
def test_per_group_beats_per_channel_on_groups_of_different_scales(base: np.ndarray, exps: list[int],
                                                                   dtype: str) -> None:
    groups = _with_peak(base.reshape(4, 4, 8)) * torch.tensor([100.0**e for e in exps]).reshape(1, 4, 1)
    t = groups.reshape(4, 32)
    kw = {"dtype": dtype, "scale_dtype": "float32"}
    group = _mean_row_relative_mse(t, _scheme(granularity="group", group_size=8, **kw), row=8)
    channel = _mean_row_relative_mse(t, _scheme(granularity="channel", **kw), row=8)
    assert group < channel  # per group of 8: the quiet groups are what group scales are for


@FAST
@given(shape=st.sampled_from([(3, 8), (2, 4, 8), (4, 2, 3, 8)]),
       dtype=st.sampled_from(["int8", "int4", "uint4", "nf4", "fp8_e4m3", "float16", "bfloat16"]),
       gran=st.sampled_from(["tensor", "channel", "group"]))
def test_zero_tensor_exact(shape: tuple[int, ...], dtype: str, gran: str) -> None:
    x = torch.zeros(shape)
    assert torch.equal(fake_quantize(x, _scheme(dtype=dtype, granularity=gran, group_size=8)), x)


@pytest.mark.parametrize("shape,axis", [((6, 4, 3, 3), 0), ((6, 4, 3, 3), 1), ((5, 3, 7), 2)])
@pytest.mark.parametrize("in_dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_conv_weights_channel_axis(shape: tuple[int, ...], axis: int, in_dtype: torch.dtype) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(in_dtype)
    qt = quantize(x, _scheme(dtype="int8", granularity="channel", axis=axis, symmetric=True))
    assert qt.scale is not None and tuple(qt.scale.shape) == (shape[axis],)
    # The scale of channel i is set by the absmax of x.select(axis, i).
    absmax = x.float().movedim(axis, 0).reshape(shape[axis], -1).abs().amax(1)
    assert torch.all(qt.scale.float() >= absmax / 127.5)
    assert torch.all(qt.scale.float() <= absmax / 127.5 * (1 + 2**-10))
    x_hat = dequantize(qt, dtype=in_dtype)
    assert x_hat.dtype == in_dtype and x_hat.shape == x.shape
    # Bound checked on the float32 x̂: a bf16 x̂ is rounded more coarsely than int8 steps.
    assert float((x.float() - dequantize(qt)).abs().max()) <= float(qt.scale.float().max()) / 2 * 1.0001
