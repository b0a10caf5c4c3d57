from __future__ import annotations

import math

import pytest
import torch

from quantd.engine.analysis import compare_bit_widths, outlier_impact, scale_sensitivity
from quantd.errors import ConfigError
from quantd_client import Scheme


def _uniform(n: int = 1 << 16) -> torch.Tensor:
    return (torch.rand(64, n // 64, generator=torch.Generator().manual_seed(0)) * 2 - 1)


def _laplace(n: int = 1 << 16) -> torch.Tensor:
    u = torch.rand(64, n // 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64) - 0.5
    return (-u.sign() * torch.log1p(-2 * u.abs())).float()


def test_bit_widths_follow_6db_per_bit_on_uniform_data() -> None:
    res = compare_bit_widths(_uniform(), Scheme(granularity="tensor", symmetric=False))
    assert [r.dtype for r in res] == ["int8", "int4", "int3", "int2"]
    assert [r.bits for r in res] == [8, 4, 3, 2]
    sqnr = [r.sqnr_db for r in res]
    assert all(s is not None for s in sqnr)
    assert sqnr == sorted(sqnr, reverse=True)  # type: ignore[type-var]
    for r in res[:2]:
        # full-scale uniform signal over 2^b − 1 steps: SQNR = (1/3)/(step²/12) = 20·log10(2^b − 1) dB
        assert r.sqnr_db is not None and abs(r.sqnr_db - 20 * math.log10(2**r.bits - 1)) < 0.15
        assert r.theoretical_sqnr_db == pytest.approx(6.02 * r.bits + 1.76)
        assert r.stats.mse == pytest.approx(10 ** (-r.sqnr_db / 10) * float(_uniform().pow(2).mean()), rel=1e-6)


def test_outlier_impact_clipping_tradeoff() -> None:
    x = _laplace()
    res = outlier_impact(x, Scheme(dtype="int4", symmetric=True, granularity="tensor"))
    by_p = {r.percentile: r for r in res}
    assert by_p[100.0].clipped_fraction == 0.0
    assert 0.005 < by_p[99.0].clipped_fraction < 0.015
    assert by_p[99.9].mse < by_p[100.0].mse  # int4 on heavy tails: clipping a little pays
    r99 = by_p[99.0]
    assert r99.mse_outliers is not None and r99.mse_inliers is not None
    assert r99.mse_outliers > 10 * r99.mse_inliers  # the clipped tail carries the error
    assert 0.01 < r99.outlier_fraction < 0.03  # Laplace: P(|x| > 3·√2) ≈ 1.4 %
    with pytest.raises(ConfigError, match="percentile"):
        outlier_impact(x, Scheme(granularity="tensor"), percentiles=(0.0,))


def test_scale_sensitivity_matches_step_size_theory() -> None:
    x = _uniform()
    res = scale_sensitivity(x, Scheme(dtype="int8", symmetric=True, granularity="channel", scale_dtype="float32"))
    assert [r.perturbation for r in res] == [-0.1, -0.05, -0.02, 0.02, 0.05, 0.1]
    for r in res:
        assert r.scale_ratio == pytest.approx(1 + r.perturbation, rel=1e-5)
        assert r.relative_mse_change is not None and r.relative_mse_change > 0  # minmax is optimal here
    up = res[-1]  # a 10 % larger step: MSE ∝ step² → +21 %
    assert up.relative_mse_change == pytest.approx(0.21, abs=0.03)
    assert res[0].relative_mse_change is not None and res[0].relative_mse_change > up.relative_mse_change  # clipping
