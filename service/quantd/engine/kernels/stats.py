"""Compiled twins of ``stats``: every float64 sum of a chunk in one pass over ``x`` and ``x̂``, the outlier
and clipping counts in one more."""

from __future__ import annotations

import math

import torch

from . import KERNELS


def _float64(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64; bfloat16 and float16 through float32 (exact): Inductor's direct conversion of theirs is
    not vectorised."""
    return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).double()


def _moments(x: torch.Tensor, x_hat: torch.Tensor, abs_x: bool = True) -> torch.Tensor:
    a = _float64(x)
    b = _float64(x_hat)
    dims = tuple(range(1, a.dim()))  # every dim but the chunks' (reducing them as they are vectorises;
    n_c = 1  # flattening a broadcast x̂ first does not)
    for d in dims:
        n_c = n_c * a.shape[d]
    # Σ (x − mean_c)² of each chunk from sums shifted by its first element k: Σ(x − k)² − (Σ(x − k))² / n_c.
    # One pass: centring on the chunk's mean needs that mean first, a second loop over the chunk. As exact:
    # k is one of the chunk's values, so (k − mean_c)² ≤ Σ (x − mean_c)², and the subtraction cancels at most
    # log2(n_c + 1) bits (for an extreme outlier first: 18 of float64's 53 in a chunk of 2¹⁸ values; about 1 when
    # k is typical).
    k = a[(slice(None), *((slice(0, 1),) * len(dims)))]
    shifted = a - k
    sum_shifted = shifted.sum(dim=dims)
    m2 = ((shifted * shifted).sum(dim=dims) - sum_shifted * sum_shifted / n_c).clamp(min=0.0)
    sum_x = a.sum(dim=dims)
    err = (a - b).abs()
    # max |x| only when asked: a pass of its own over each chunk (Inductor does not fuse it with the
    # error sums, whose loops follow x̂'s broadcast), and a latency-bound one (a NaN-propagating max)
    max_abs_x = a.abs().amax(dim=dims) if abs_x else torch.full_like(sum_x, math.nan)
    return torch.stack([
        torch.full_like(sum_x, n_c), sum_x, m2, (a * a).sum(dim=dims),
        (b * b).sum(dim=dims), (a * b).sum(dim=dims), (err * err).sum(dim=dims), err.sum(dim=dims),
        err.amax(dim=dims), max_abs_x,
    ], dim=1)


def moments(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor | None:
    """Per row of ``x``/``x_hat`` ``[n, chunk]`` the float64 sums of ``stats._chunk_sums`` (same order
    of columns), ``[n, 10]``, in one pass over both."""
    return KERNELS.call("moments", _moments, (x.dtype, x_hat.dtype), x, x_hat)


def _moments_from_codes(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                        codebook: torch.Tensor, nf4: bool) -> torch.Tensor:
    # x̂ in float64: a code (or a float32 nf4 level) times a float32 scale is exact there (≤ 48 bits). nf4 levels
    # by a gather here: with _nf4_level's selects this kernel's loops over [n, rows, K] do not vectorise.
    if nf4:
        x_hat = codebook[codes.long()].double() * scale.double()
    else:
        x_hat = (codes.double() - zero_point.double()) * scale.double()
    # x + 0·s is x exactly (scales are finite: choose_qparams clamps them; only a −0 becomes +0), but indexed by
    # block row like x̂: so Inductor reduces x's own sums in the loop of the error sums. Otherwise it merges x's
    # rows and columns into a loop of its own, a second read of x. (0·zero point, the same value, keeps the nf4
    # kernel's loops from vectorising.)
    return _moments(_float64(x) + scale.double() * 0.0, x_hat, abs_x=False)


def moments_from_codes(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                       codebook: torch.Tensor, *, nf4: bool) -> torch.Tensor | None:
    """:func:`moments` of ``x`` against its codes dequantized exactly (in float64) on the fly, never stored: ``x`` and
    ``codes`` ``[n, rows, K]``, scale and zero point ``[n, rows, 1]``; one row of sums per chunk ``n``. Its max
    ``|x|`` column is NaN: only float casts' statistics use it, and their ``x̂`` is not made from codes."""
    return KERNELS.call("moments_codes", _moments_from_codes, (x.dtype, codes.dtype, nf4),
                        x, codes, scale, zero_point, codebook, nf4)


def _outliers(x: torch.Tensor, mean: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    return ((_float64(x) - mean).abs() > threshold).sum()


def _outside(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return ((xf < lo) | (xf > hi)).sum()


# Steps of one float32 ulp tried from the rounded bound before giving up on float32 bounds (they are found within 1).
_BOUND_STEPS = 8


def _float32_interval(mean: float, threshold: float) -> tuple[float, float] | None:
    """The float32 values ``lo ≤ hi`` with ``|v − mean| ≤ threshold`` (in float64, as the outlier count computes it)
    exactly for the float32 ``v`` in ``[lo, hi]``; None when there are none, or they were not found within
    :data:`_BOUND_STEPS` ulps of ``mean ∓ threshold`` rounded to float32 (then the count stays in float64).
    ``v − mean`` rounded to float64 is monotone in ``v``, so these ``v`` are an interval; its ends are that
    near but for means far beyond the threshold and float32's range (e.g. ±1e39), which fall back."""
    import numpy as np

    top = float(np.finfo(np.float32).max)

    def inside(v: np.float32) -> bool:
        return abs(float(v) - mean) <= threshold

    def end(start: float, outward: float) -> float | None:
        v = np.float32(min(max(start, -top), top))
        toward_mean = np.float32(-outward)
        for _ in range(_BOUND_STEPS):
            if inside(v):
                beyond = np.nextafter(v, np.float32(outward))
                if not inside(beyond) or not math.isfinite(float(beyond)):
                    return float(v)
                v = beyond
            else:
                v = np.nextafter(v, toward_mean)
        return None

    if not (math.isfinite(mean) and math.isfinite(threshold)):
        return None
    with np.errstate(over="ignore"):  # stepping past float32's largest value gives inf: that end is then found
        hi, lo = end(mean + threshold, math.inf), end(mean - threshold, -math.inf)
    return None if hi is None or lo is None or lo > hi else (lo, hi)


def outlier_count(x: torch.Tensor, mean: float, threshold: float) -> torch.Tensor | None:
    """``#{|x − mean| > threshold}`` computed in float64 (a 0-d int64 tensor). For float32, bfloat16 and float16
    ``x`` the same count by two float32 comparisons against the ends of the interval that is not outlying
    (:func:`_float32_interval`): no float64 per element."""
    flat = x.reshape(-1)
    bounds = _float32_interval(mean, threshold) if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else None
    if bounds is not None:
        lo, hi = (torch.full((), b, dtype=torch.float32, device=x.device) for b in bounds)
        return KERNELS.call("outside", _outside, (x.dtype,), flat, lo, hi)
    m = torch.full((), mean, dtype=torch.float64, device=x.device)
    t = torch.full((), threshold, dtype=torch.float64, device=x.device)
    return KERNELS.call("outliers", _outliers, (x.dtype,), flat, m, t)
