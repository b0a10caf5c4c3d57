"""The observers that read the range off the values: ``minmax``, ``ema`` (on one tensor), ``percentile`` and
``meanstd``."""

from __future__ import annotations

import math

import torch

from quantd_client import Scheme
from quantd_client._dtypes import DTypeInfo

from .base import CHUNK_ELEMENTS, register


@register("minmax")
@register("ema")  # on one weight tensor there is nothing to average over (streams: ActivationObserver)
def minmax_range(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scheme: Scheme,
                 info: DTypeInfo) -> tuple[torch.Tensor, torch.Tensor]:
    return lo, hi


@register("meanstd")
def meanstd_range(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scheme: Scheme,
                  info: DTypeInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """``mean ± k·std`` clipped to ``[lo, hi]``, in float64: float32 squares of weights near 1e20 overflow."""
    var, mean = torch.var_mean(x.double(), dim=1, correction=0)
    spread = float(scheme.observer_args.get("k", 3.0)) * var.sqrt()
    return (torch.maximum(mean - spread, lo.double()).float(), torch.minimum(mean + spread, hi.double()).float())


@register("percentile")
def percentile_observer(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scheme: Scheme,
                        info: DTypeInfo) -> tuple[torch.Tensor, torch.Tensor]:
    return percentile_range(x, float(scheme.observer_args.get("percentile", 99.99)), symmetric=scheme.symmetric)


def _upper_quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.quantile(x, q, dim=1)`` (linear interpolation), from the top ``K − ⌊q(K−1)⌋`` values only."""
    rows, k = x.shape
    pos = q * (k - 1)
    i0 = min(math.floor(pos), k - 1)
    i1 = min(i0 + 1, k - 1)
    frac = pos - i0
    out = torch.empty(rows, dtype=x.dtype, device=x.device)
    tail = k - i0  # values at ascending indices i0 and i1 are the tail-th and (tail−1)-th largest
    step = max(1, CHUNK_ELEMENTS // max(k, 1))
    for r in range(0, rows, step):
        xc = x[r:r + step]
        if tail <= k // 2 + 1:
            top = torch.topk(xc, tail, dim=1, largest=True, sorted=True).values
            v0, v1 = top[:, tail - 1], top[:, max(tail - 2, 0)]
        else:
            v0 = torch.kthvalue(xc, i0 + 1, dim=1).values
            v1 = torch.kthvalue(xc, i1 + 1, dim=1).values if i1 != i0 else v0
        out[r:r + step] = v0 + (v1 - v0) * frac
    return out


def percentile_range(x: torch.Tensor, p: float, *, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Range from the ``p``-th percentile per row of ``x[B, K]`` (exact, any size)."""
    q = p / 100.0
    if symmetric:
        hi = _upper_quantile(x.abs(), q)
        return -hi, hi
    # Q_{1−q}(x) = −Q_q(−x): the lower tail is the upper tail of −x.
    return -_upper_quantile(-x, q), _upper_quantile(x, q)


