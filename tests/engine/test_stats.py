"""ErrorStats against NumPy float64 definitions, and the bounds it promises."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from quantd.engine import stats
from quantd.engine.primitives import dequantize, quantize
from quantd.engine.stats import bits_per_weight, error_stats, theoretical_sqnr_db
from quantd.errors import ConfigError
from quantd_client import ErrorStats, Scheme


def _scheme(**kw: object) -> Scheme:
    return Scheme.model_validate(kw)


SCHEMES = [
    _scheme(dtype="int8", granularity="channel"),
    _scheme(dtype="int4", granularity="group", group_size=16, scale_dtype="bfloat16"),
    _scheme(dtype="int3", granularity="tensor", symmetric=True),
    _scheme(dtype="uint4", granularity="group", group_size=32),
    _scheme(dtype="nf4", granularity="group", group_size=16),
    _scheme(dtype="fp8_e4m3", granularity="channel"),
    _scheme(dtype="fp8_e5m2", granularity="tensor"),
    _scheme(dtype="float16"),
    _scheme(dtype="bfloat16"),
]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.dtype}-{s.granularity}")
def test_matches_numpy_definitions(scheme: Scheme) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g) * 0.05 + 0.01
    x[3, 5] = 0.9  # an outlier
    qt = quantize(x, scheme)
    x_hat = dequantize(qt)
    st = error_stats(x, x_hat, qt)
    a, b = x.double().numpy(), x_hat.double().numpy()
    e = a - b
    mse = float(np.mean(e**2))
    assert st.numel == 512
    assert st.mse == pytest.approx(mse, rel=1e-9)
    assert st.mae == pytest.approx(float(np.mean(np.abs(e))), rel=1e-9)
    assert st.max_abs_error == pytest.approx(float(np.max(np.abs(e))), rel=1e-12)
    assert st.sqnr_db == pytest.approx(10 * math.log10(float(np.mean(a**2)) / mse), rel=1e-9)
    cos = float(np.dot(a.ravel(), b.ravel()) / (np.linalg.norm(a) * np.linalg.norm(b)))
    assert st.cosine == pytest.approx(cos, rel=1e-12)
    thr = 3 * float(np.std(a))
    assert st.outlier_threshold == pytest.approx(thr, rel=1e-9)
    assert st.outlier_rate == float(np.mean(np.abs(a - a.mean()) > thr))
    assert st.outlier_rate >= 1 / 512  # the planted outlier counts
    assert st.clipped_fraction == 0.0  # min-max ranges are always representable
    assert st.theoretical_max_error is not None
    assert st.max_abs_error <= st.theoretical_max_error * (1 + 1e-6)
    assert st.compression_ratio == pytest.approx(32 / st.bits_per_weight)


def test_integer_bound_is_half_the_largest_scale() -> None:
    x = torch.randn(4, 32) * torch.tensor([[0.1], [1.0], [10.0], [0.5]])
    qt = quantize(x, _scheme(dtype="int4", granularity="channel", symmetric=True))
    st = error_stats(x, dequantize(qt), qt)
    assert qt.scale is not None
    assert st.theoretical_max_error == pytest.approx(float(qt.scale.float().max()) / 2)
    assert st.theoretical_sqnr_db == pytest.approx(6.02 * 4 + 1.76)


@pytest.mark.parametrize("path", ["eager", "compiled"])
@pytest.mark.parametrize("scheme", [
    _scheme(dtype="int8", granularity="tensor", symmetric=True, scale_dtype="float32"),
    _scheme(dtype="int8", granularity="channel", symmetric=True, scale_dtype="float32"),
    _scheme(dtype="uint8", granularity="tensor", scale_dtype="float32"),
    _scheme(dtype="int4", granularity="group", group_size=16, scale_dtype="float32"),
], ids=lambda s: f"{s.dtype}-{s.granularity}-{'sym' if s.symmetric else 'affine'}")
def test_no_element_that_is_not_clipped_exceeds_the_bound(request: pytest.FixtureRequest, path: str,
                                                          scheme: Scheme) -> None:
    """CONTRACT §4: elements not clipped never exceed ``theoretical_max_error``, exactly (no tolerance).
    With float32 scales, float32's ``c · s`` rounds past ``s/2`` for the largest element of a third of
    these tensors; the statistics' ``x̂`` is exact (float64)."""
    request.getfixturevalue(path)
    for seed in range(40):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(seed)) * 10.0 ** (seed % 7 - 3)
        qt = quantize(x, scheme)
        st = stats.quantized_error_stats(x, qt)
        assert st.clipped_fraction == 0.0
        assert st.theoretical_max_error is not None and st.max_abs_error <= st.theoretical_max_error, seed
        want = (x.double() - dequantize(qt, dtype=torch.float64)).abs().max()
        assert st.max_abs_error == float(want)


def test_float64_dequantize_is_exact() -> None:
    """``dequantize(dtype=float64)`` is the exact ``(c − zp) · s``; float32's is that rounded once."""
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    for scheme in (_scheme(dtype="int8", granularity="channel", scale_dtype="float32"),
                   _scheme(dtype="nf4", granularity="group", group_size=16, scale_dtype="float32")):
        qt = quantize(x, scheme)
        assert qt.scale is not None
        exact = dequantize(qt, dtype=torch.float64)
        if scheme.dtype == "nf4":
            levels = torch.tensor(stats.NF4_CODEBOOK, dtype=torch.float32).double()[qt.codes.long()]
            want = levels * qt.scale.double().repeat_interleave(16, dim=1)
        else:
            assert qt.zero_point is not None
            want = (qt.codes.double() - qt.zero_point.double().reshape(-1, 1)) * qt.scale.double().reshape(-1, 1)
        assert torch.equal(exact, want)
        assert torch.equal(dequantize(qt), exact.float())


def test_fp8_nf4_float_bounds() -> None:
    x = torch.randn(2, 64)
    for dtype, factor in (("fp8_e4m3", 16.0), ("fp8_e5m2", 4096.0), ("nf4", (1 - 0.6961928009986877) / 2)):
        qt = quantize(x, _scheme(dtype=dtype, granularity="channel"))
        assert qt.scale is not None
        got = stats.theoretical_max_error(qt, 0.0)
        assert got == pytest.approx(factor * float(qt.scale.float().max()))
    qt = quantize(torch.tensor([[3.0, -1.0]]), _scheme(dtype="float16"))
    assert stats.theoretical_max_error(qt, 3.0) == 2.0**-10  # ulp at 3.0 is 2^-9
    qt = quantize(torch.tensor([[3.0, -1.0]]), _scheme(dtype="bfloat16"))
    assert stats.theoretical_max_error(qt, 3.0) == 2.0**-7


def test_clipped_fraction_counts_elements_outside_range() -> None:
    x = torch.linspace(-1, 1, 64).reshape(1, 64)
    scheme = _scheme(dtype="int8", granularity="tensor", symmetric=True)
    qt = quantize(x, scheme, observer_range=(torch.tensor(-0.5), torch.tensor(0.5)))
    st = error_stats(x, dequantize(qt), qt)
    assert qt.scale is not None
    limit = (127.5 * float(qt.scale.float()))  # a half step beyond qmax, and symmetric on the low side
    expected = float(((x > limit) | (x < -128.5 * float(qt.scale.float()))).double().mean())
    assert expected > 0.4 and st.clipped_fraction == pytest.approx(expected)
    e = (x - dequantize(qt)).abs()
    unclipped = x.abs() <= limit
    assert float(e[unclipped].max()) <= st.theoretical_max_error  # type: ignore[operator]
    assert float(e[~unclipped].max()) > st.theoretical_max_error  # type: ignore[operator]


@pytest.mark.parametrize("scheme", [
    _scheme(dtype="int4", granularity="group", group_size=8, symmetric=False),
    _scheme(dtype="uint4", granularity="channel"),
    _scheme(dtype="nf4", granularity="group", group_size=8),
    _scheme(dtype="fp8_e5m2", granularity="channel"),
], ids=lambda s: s.dtype)
def test_clipped_count_only_in_blocks_that_clip(scheme: Scheme, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 32, generator=g)
    full = quantize(x, scheme)
    blocks = x.reshape(full.scale.numel(), -1)  # type: ignore[union-attr]
    lo, hi = blocks.amin(dim=1), blocks.amax(dim=1)
    shrink = torch.ones_like(lo)
    shrink[::2] = 0.3  # every other block's range shrunk to 30 %
    qt = quantize(x, scheme, observer_range=(lo * shrink, hi * shrink))
    assert qt.scale is not None
    q = blocks / qt.scale.reshape(-1, 1).float()
    if qt.dtype in ("int4", "uint4"):
        zp = torch.zeros(1) if qt.zero_point is None else qt.zero_point.reshape(-1, 1).float()
        lim_lo, lim_hi = (-8 if qt.dtype == "int4" else 0) - 0.5 - zp, (7 if qt.dtype == "int4" else 15) + 0.5 - zp
        outside = (q < lim_lo) | (q > lim_hi)
    elif qt.dtype == "nf4":  # beyond the end levels ±1 by more than half the gap next to them
        outside = (q < -1 - (1 - 0.6961928009986877) / 2) | (q > 1 + (1 - 0.7229568362236023) / 2)
    else:  # e5m2: beyond 57344 by more than half its top step (8192)
        outside = q.abs() > 57344.0 + 4096.0
    expected = int(outside.sum())
    assert expected > 0 and int(outside[1::2].sum()) == 0  # only the shrunk blocks clip
    monkeypatch.setattr(stats, "_CHUNK", 40)  # several chunks of suspect rows
    assert stats.clipped_count(x, qt) == expected


def test_float16_cast_clips_beyond_max() -> None:
    x = torch.tensor([[1.0, 70000.0, -1e6, 2.0]])
    qt = quantize(x, _scheme(dtype="float16"))
    st = error_stats(x, dequantize(qt), qt)
    assert st.clipped_fraction == 0.5
    assert st.bits_per_weight == 16.0 and st.compression_ratio == 2.0


def test_exact_reconstruction_has_null_sqnr() -> None:
    x = torch.tensor([[0.5, -0.25, 1.0, 0.0]])  # exactly representable in float16
    qt = quantize(x, _scheme(dtype="float16"))
    st = error_stats(x, dequantize(qt), qt)
    assert st.mse == 0.0 and st.sqnr_db is None and st.cosine == 1.0
    z = torch.zeros(2, 8)
    qz = quantize(z, _scheme(dtype="int4", granularity="channel"))
    sz = error_stats(z, dequantize(qz), qz)
    assert sz.sqnr_db is None and sz.cosine == 1.0 and sz.outlier_rate == 0.0


@pytest.mark.parametrize("scheme,expected", [
    (_scheme(dtype="int4", group_size=128), 4 + 16 / 128 + 8 / 128),
    (_scheme(dtype="int4", group_size=64, symmetric=True, scale_dtype="float32"), 4 + 32 / 64),
    (_scheme(dtype="int8", granularity="channel", symmetric=True), 8 + 16 / 256),
    (_scheme(dtype="nf4", group_size=64), 4 + 16 / 64),
    (_scheme(dtype="int3", granularity="tensor"), 3 + (16 + 8) / (8 * 256)),
    (_scheme(dtype="fp8_e4m3", granularity="channel", scale_dtype="bfloat16"), 8 + 16 / 256),
])
def test_bits_per_weight_counts_scales_and_zero_points(scheme: Scheme, expected: float) -> None:
    qt = quantize(torch.randn(8, 256), scheme)
    assert bits_per_weight(qt) == pytest.approx(expected)


def test_bf16_input_compression_ratio() -> None:
    x = torch.randn(8, 256).to(torch.bfloat16)
    qt = quantize(x, _scheme(dtype="int4", group_size=128))
    st = error_stats(x, dequantize(qt, dtype=torch.bfloat16), qt)
    assert st.compression_ratio == pytest.approx(16 / (4 + 24 / 128))


def test_chunked_sums_equal_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(16, 64) + 100.0  # a large mean: naive E[x²] − E[x]² would lose digits
    qt = quantize(x, _scheme(dtype="int8", granularity="channel"))
    x_hat = dequantize(qt)
    whole = error_stats(x, x_hat, qt)
    monkeypatch.setattr(stats, "_CHUNK", 37)
    chunked = error_stats(x, x_hat, qt)
    for field in ("mse", "mae", "max_abs_error", "cosine", "outlier_threshold", "sqnr_db"):
        assert getattr(chunked, field) == pytest.approx(getattr(whole, field), rel=1e-9), field
    assert whole.outlier_threshold == pytest.approx(3 * float(x.double().std(unbiased=False)), rel=1e-9)


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s.dtype not in ("float16", "bfloat16")]
                         + [_scheme(dtype="int4", granularity="group", group_size=16, observer="percentile",
                                    observer_args={"percentile": 99.0})],
                         ids=lambda s: f"{s.dtype}-{s.granularity}-{s.observer}")
@pytest.mark.parametrize("chunk", [100, 96])  # whole chunks and a tail; chunks that split one scale's block
def test_compiled_stats_equal_eager(compiled: None, scheme: Scheme, chunk: int,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from quantd.engine import kernels

    monkeypatch.setattr(stats, "_CHUNK", chunk)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(24, 96, generator=gen) * torch.rand(24, 1, generator=gen) + 0.5
    x[3, 7], x[20, 1] = 40.0, -35.0  # outliers, clipped by the percentile observer
    qt = quantize(x, scheme)
    x_hat = dequantize(qt, dtype=torch.float64)  # exact: the statistics' x̂
    got = error_stats(x, x_hat, qt)
    fused = stats.quantized_error_stats(x, qt)  # x̂ decoded inside the kernel, never stored
    assert stats._moments_from_codes(x, qt) is not None
    kernels.KERNELS.reset(available=False)
    want = error_stats(x, x_hat, qt)
    eager = stats.quantized_error_stats(x, qt)  # x̂ decoded chunk by chunk into a float64 buffer
    kernels.KERNELS.reset(available=True)
    for result in (got, fused, eager):
        _assert_stats_agree(result, want)
    assert got.outlier_rate > 0
    if scheme.observer == "percentile":
        assert got.clipped_fraction > 0


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", ["int8", "int4", "nf4"])
def test_compiled_stats_of_half_precision_weights_equal_eager(compiled: None, in_dtype: torch.dtype, dtype: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # bfloat16/float16 weights reach the compiled sums through float32 (their direct float64 conversion is not
    # vectorised) and the outlier count through float32 bounds: the same statistics as eager.
    from quantd.engine import kernels

    monkeypatch.setattr(stats, "_CHUNK", 96)
    x = (torch.randn(24, 96, generator=torch.Generator().manual_seed(6)) * 2 + 0.75).to(in_dtype)
    qt = quantize(x, _scheme(dtype=dtype, granularity="group", group_size=32))
    assert stats._moments_from_codes(x, qt) is not None
    got = stats.quantized_error_stats(x, qt)
    kernels.KERNELS.reset(available=False)
    want = stats.quantized_error_stats(x, qt)
    kernels.KERNELS.reset(available=True)
    _assert_stats_agree(got, want)
    assert got.outlier_rate > 0


def _assert_stats_agree(got: ErrorStats, want: ErrorStats) -> None:
    """Compiled against eager statistics: float sums to 1e-12 relative (another summation order), the rest equal."""
    for field, value in want.model_dump().items():
        if isinstance(value, float) and math.isfinite(value):
            assert getattr(got, field) == pytest.approx(value, rel=1e-12, abs=1e-300), field
        else:
            assert getattr(got, field) == value, field


@pytest.mark.parametrize("first", [None, 1e6, -3e6])
def test_compiled_variance_with_a_large_mean_and_an_extreme_first_value(compiled: None, first: float | None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # The compiled sums shift each chunk by its first value instead of centring it on its mean: as exact,
    # also when the data sit far from 0 and when that first value is an extreme outlier.
    monkeypatch.setattr(stats, "_CHUNK", 96)
    x = torch.randn(24, 96, generator=torch.Generator().manual_seed(8)) + 1e4
    if first is not None:
        x[0, 0] = first
        x[5, 0] = first  # also the first value of a later chunk
    qt = quantize(x, _scheme(dtype="int8", granularity="channel"))
    assert stats._moments_from_codes(x, qt) is not None
    std = float(x.double().std(unbiased=False))
    for st in (stats.quantized_error_stats(x, qt), error_stats(x, dequantize(qt, dtype=torch.float64), qt)):
        assert st.outlier_threshold == pytest.approx(3 * std, rel=1e-11)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_outlier_count_in_float32_is_the_float64_count(compiled: None, in_dtype: torch.dtype) -> None:
    # The compiled count compares float32 values with the float32 ends of the interval that is not outlying;
    # exactly the float64 |x − mean| > threshold, also for values on and next to mean ± threshold.
    from quantd.engine import kernels

    gen = torch.Generator().manual_seed(21)
    cases = [(0.0, 0.0), (0.1, 0.0), (0.0123, 2.5), (-3.7, 1e-3), (1e4, 7.25), (0.5, 65504.0), (0.0, 3.4e38),
             (0.0, 3.5e38), (-1e39, 2e39)]  # the last two: past float32's largest value
    for mean, threshold in cases:
        assert (kernels.stats._float32_interval(mean, threshold) is None) == (threshold == 0.0 and mean == 0.1)
        edges = torch.tensor([mean - threshold, mean + threshold, mean, 0.0], dtype=torch.float64).float()
        near = torch.cat([edges, torch.nextafter(edges, torch.tensor(math.inf)),
                          torch.nextafter(edges, torch.tensor(-math.inf))])
        x = torch.cat([near, torch.randn(5000, generator=gen) * max(threshold, 1.0) + mean]).to(in_dtype)
        x = x[torch.isfinite(x)]
        want = int(((x.double() - mean).abs() > threshold).sum())
        got = kernels.stats.outlier_count(x, mean, threshold)
        assert got is not None and int(got) == want, (mean, threshold)
        assert stats.outlier_count(x, mean, threshold) == want
    assert kernels.stats._float32_interval(0.1, 0.0) is None  # no float32 value is 0.1 exactly: the float64 count
    assert kernels.stats._float32_interval(0.5, 0.0) == (0.5, 0.5)


def test_shape_mismatch_is_an_error() -> None:
    x = torch.randn(4, 8)
    qt = quantize(x, _scheme(dtype="int8", granularity="channel"))
    with pytest.raises(ConfigError, match="one shape"):
        error_stats(x, torch.zeros(8, 4), qt)


def test_theoretical_sqnr_formula() -> None:
    assert theoretical_sqnr_db(8) == pytest.approx(49.92)
    assert theoretical_sqnr_db(4) == pytest.approx(25.84)


@pytest.mark.parametrize("dtype", ["nf4", "fp8_e4m3"])
def test_nf4_and_fp8_count_as_clipped_only_beyond_half_a_step(dtype: str) -> None:
    # As for integer dtypes: a value within half a step beyond the end level rounds onto it anyway, its
    # error within the bound. Counting every |x/s| beyond the end level would flag elements off by a hair
    # (with a percentile range, ~1 % of a g64 weight).
    top, step = (1.0, 1 - 0.7229568362236023) if dtype == "nf4" else (448.0, 32.0)
    s = 0.5
    x = torch.tensor([[top * s, (top + 0.4 * step) * s, (top + 0.6 * step) * s, -top * s, 0.1]])
    qt = quantize(x, _scheme(dtype=dtype, granularity="tensor"), observer_range=(torch.tensor(-top * s),
                                                                                  torch.tensor(top * s)))
    assert qt.scale is not None and float(qt.scale.float()) == s  # the end level is top · s
    st = stats.quantized_error_stats(x, qt)
    assert st.clipped_fraction == pytest.approx(1 / 5)  # only the one 0.6 steps beyond
    e = (x.double() - dequantize(qt, dtype=torch.float64)).abs()[0]
    assert float(e[1]) <= st.theoretical_max_error < float(e[2])  # type: ignore[operator]


def _adversarial(case: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(48, 96, generator=g, dtype=torch.float64)
    if case == "large offset":
        return (x + 1e4).float()
    if case == "huge dynamic range":  # rows from 1e-30 to 1e30
        return (x * 10.0 ** torch.linspace(-30, 30, 48, dtype=torch.float64).reshape(-1, 1)).float()
    if case == "zeros":
        x[::3] = 0.0
        x[:, ::5] = 0.0
        return x.float()
    if case == "extremes":  # finite values at float32's ends, and its smallest subnormals
        x[1, :4] = torch.tensor([3.4e38, -3.4e38, 1e-45, -1e-45], dtype=torch.float64)
        x[7] = 3.0e38
        return x.float()
    if case == "bfloat16":
        return (x * 3 + 0.5).to(torch.bfloat16)
    return (x * 3 + 0.5).to(torch.float16)


@pytest.mark.parametrize("case", ["large offset", "huge dynamic range", "zeros", "extremes", "bfloat16", "float16"])
@pytest.mark.parametrize("scheme", [
    _scheme(dtype="int8", granularity="channel", scale_dtype="float32"),
    _scheme(dtype="int4", granularity="group", group_size=32, scale_dtype="float32"),
    _scheme(dtype="nf4", granularity="group", group_size=32, scale_dtype="float32"),
    _scheme(dtype="int4", granularity="group", group_size=32, symmetric=True, scale_dtype="bfloat16"),
    _scheme(dtype="fp8_e4m3", granularity="channel", scale_dtype="float32"),
], ids=lambda s: f"{s.dtype}-{s.granularity}-{s.scale_dtype}")
def test_eager_chunked_statistics_equal_a_float64_reference(eager: None, case: str, scheme: Scheme,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager statistics, chunk by chunk over the chunk pool (engine.parallel), against NumPy float64 on the
    exact ``x̂`` on adversarial data: sums to 1e-12 relative, max error, counts and fractions exactly."""
    from quantd.engine import parallel

    monkeypatch.setattr(parallel, "_workers", max(2, parallel.workers()))
    monkeypatch.setattr(stats, "_CHUNK", 160)  # many chunks, each cutting across block rows
    x = _adversarial(case)
    qt = quantize(x, scheme)
    st = stats.quantized_error_stats(x, qt)
    a = x.double().numpy().ravel()
    b = dequantize(qt, dtype=torch.float64).numpy().ravel()
    e = a - b
    assert st.mse == pytest.approx(float(np.mean(e**2)), rel=1e-12, abs=0.0)
    assert st.mae == pytest.approx(float(np.mean(np.abs(e))), rel=1e-12, abs=0.0)
    assert st.max_abs_error == float(np.max(np.abs(e)))
    power = float(np.mean(a**2))
    if st.sqnr_db is not None:
        assert st.sqnr_db == pytest.approx(10 * math.log10(power / float(np.mean(e**2))), rel=1e-12)
    cos = float(np.dot(a, b) / math.sqrt(float(np.dot(a, a)) * float(np.dot(b, b))))
    assert st.cosine == pytest.approx(min(1.0, cos), rel=1e-12)
    mean, std = float(np.mean(a)), float(np.sqrt(np.mean((a - np.mean(a)) ** 2)))
    assert st.outlier_threshold == pytest.approx(3 * std, rel=1e-10)
    assert st.outlier_rate == float(np.mean(np.abs(a - mean) > st.outlier_threshold))
    assert st.clipped_fraction == 0.0  # min-max ranges
    assert st.theoretical_max_error is not None and st.max_abs_error <= st.theoretical_max_error


@pytest.mark.parametrize("chunk", [96, 100, 5000])  # whole block rows per chunk: ranges taken on the way
def test_eager_clipped_count_from_the_chunk_loops_ranges(eager: None, chunk: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats, "_CHUNK", chunk)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(24, 96, generator=gen)
    x[3, 7], x[20, 1] = 40.0, -35.0
    qt = quantize(x, _scheme(dtype="int4", group_size=32, observer="percentile", observer_args={"percentile": 99.0}))
    m = stats._moments_from_codes(x, qt)
    assert m is not None and m.block_ranges is not None
    blocks = x.reshape(-1, 32)
    assert torch.equal(m.block_ranges[0], blocks.amin(dim=1)) and torch.equal(m.block_ranges[1], blocks.amax(dim=1))
    st = stats.quantized_error_stats(x, qt)
    assert st.clipped_fraction == stats.clipped_count(x, qt) / x.numel() > 0
