"""Analyses of one tensor under quantization: bit widths, outlier clipping, scale sensitivity.

Each returns a list of wire models (quantd_client; ``/v1/analyze`` returns them on request):

- :func:`compare_bit_widths`: the same scheme at several integer dtypes, the measured SQNR next to
  the 6.02·b + 1.76 dB of an ideal b-bit quantizer.
- :func:`outlier_impact`: the range clipped at several percentiles (100 = min-max); MSE, SQNR, the
  clipped fraction, and the MSE on the outliers (``|x − mean| > 3σ``, as ``ErrorStats``) vs the rest.
- :func:`scale_sensitivity`: every scale multiplied by ``1 + p`` (the observed range scaled, so the
  zero point stays), the MSE change relative to the unperturbed scales.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from quantd.engine.granularity import block_view, granularity_of
from quantd.engine.observers import observe_range, percentile_range
from quantd.engine.primitives import dequantize, quantize
from quantd.engine.stats import OUTLIER_STDS, quantized_error_stats, theoretical_sqnr_db
from quantd.errors import ConfigError
from quantd_client import BitWidthResult, OutlierImpactResult, ScaleSensitivityResult, Scheme
from quantd_client._dtypes import dtype_info

__all__ = [
    "BitWidthResult",
    "OutlierImpactResult",
    "ScaleSensitivityResult",
    "compare_bit_widths",
    "outlier_impact",
    "scale_sensitivity",
]


def _with_dtype(scheme: Scheme, dtype: str) -> Scheme:
    data = scheme.model_dump()
    data["dtype"] = dtype
    info = dtype_info(dtype)
    if info.kind != "int" or not info.signed:
        data["symmetric"] = info.kind != "int"
    return Scheme.model_validate(data)


def compare_bit_widths(x: torch.Tensor, scheme_base: Scheme,
                       dtypes: Sequence[str] = ("int8", "int4", "int3", "int2"), *,
                       name: str = "tensor") -> list[BitWidthResult]:
    """``scheme_base`` at each integer dtype of ``dtypes`` (its granularity, observer, symmetry)."""
    out = []
    for d in dtypes:
        info = dtype_info(d)
        if info.kind != "int":
            raise ConfigError(f"compare_bit_widths takes integer dtypes, not {d}", tensor=name, field="dtypes")
        scheme = _with_dtype(scheme_base, d)
        qt = quantize(x, scheme, name=name)
        stats = quantized_error_stats(x, qt)
        out.append(BitWidthResult(dtype=d, bits=info.bits, stats=stats,
                                  theoretical_sqnr_db=theoretical_sqnr_db(info.bits), sqnr_db=stats.sqnr_db))
    return out


def _blocks(x: torch.Tensor, scheme: Scheme, name: str) -> torch.Tensor:
    blocks, _ = block_view(x, granularity_of(scheme), name=name)
    return blocks.float()


def outlier_impact(x: torch.Tensor, scheme: Scheme, percentiles: Sequence[float] = (100.0, 99.99, 99.9, 99.0),
                   *, name: str = "tensor") -> list[OutlierImpactResult]:
    """Quantization error when each block's range is its ``p``-th percentile (symmetric: of ``|x|``)."""
    xf = x.float()
    blocks = _blocks(x, scheme, name)
    std, mean = torch.std_mean(xf.double(), correction=0)
    outliers = (xf.double() - mean).abs() > OUTLIER_STDS * std
    n_out = int(outliers.sum())
    out = []
    for p in percentiles:
        if not 0.0 < p <= 100.0:
            raise ConfigError(f"percentile {p} is not in (0, 100]", tensor=name, field="percentiles")
        lo, hi = percentile_range(blocks, float(p), symmetric=scheme.symmetric)
        qt = quantize(x, scheme, name=name, observer_range=(lo, hi))
        err2 = (dequantize(qt, dtype=torch.float64) - xf.double()).square()
        stats = quantized_error_stats(x, qt)
        out.append(OutlierImpactResult(
            percentile=float(p), mse=stats.mse, sqnr_db=stats.sqnr_db, clipped_fraction=stats.clipped_fraction,
            outlier_fraction=n_out / x.numel(),
            mse_outliers=float(err2[outliers].mean()) if n_out else None,
            mse_inliers=float(err2[~outliers].mean()) if n_out < x.numel() else None))
    return out


def scale_sensitivity(x: torch.Tensor, scheme: Scheme,
                      perturbations: Sequence[float] = (-0.1, -0.05, -0.02, 0.02, 0.05, 0.1), *,
                      name: str = "tensor") -> list[ScaleSensitivityResult]:
    """MSE when every scale is multiplied by ``1 + p``, relative to the scheme's own scales."""
    if dtype_info(scheme.dtype).kind == "float":
        raise ConfigError(f"{scheme.dtype} has no scale to perturb", tensor=name, field="dtype")
    xf = x.double()
    lo, hi = observe_range(_blocks(x, scheme, name), scheme, name=name)
    lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)

    def run(factor: float) -> tuple[float, torch.Tensor]:
        qt = quantize(x, scheme, name=name, observer_range=(lo * factor, hi * factor))
        if qt.scale is None:
            raise ConfigError("no scale", tensor=name, field="scale")
        return float((dequantize(qt, dtype=torch.float64) - xf).square().mean()), qt.scale.double()

    base_mse, base_scale = run(1.0)
    out = []
    for p in perturbations:
        if not p > -1.0:
            raise ConfigError(f"perturbation {p} would make the scale non-positive", tensor=name,
                              field="perturbations")
        mse, scale = run(1.0 + p)
        out.append(ScaleSensitivityResult(
            perturbation=float(p), scale_ratio=float((scale / base_scale).mean()), mse=mse,
            relative_mse_change=mse / base_mse - 1.0 if base_mse > 0 else None))
    return out
