"""Error statistics of a quantized tensor (CONTRACT §4, ``quantd_client.ErrorStats``).

Sums are accumulated in float64 over chunks (two passes over ``x``, one over ``x_hat``), so memory
stays bounded and precision does not depend on the tensor's size. Mean and variance are merged per
chunk (Chan et al.) rather than taken as ``E[x²] − E[x]²``, which cancels badly when the mean is large.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from quantd.engine.granularity import block_view
from quantd.engine.primitives import FLOAT_TORCH_DTYPES, granularity_of_qt
from quantd.engine.types import QuantizedTensor
from quantd.errors import ConfigError
from quantd_client import ErrorStats
from quantd_client._dtypes import DTYPES, NF4_CODEBOOK

_CHUNK = 1 << 18  # float64 elements per chunk: 2 MiB
OUTLIER_STDS = 3.0
ZERO_POINT_BITS = 8

_FP8_TOP_STEP = {  # the fp8 step between the two largest finite values: 2^(floor(log2 max) − mantissa bits)
    "fp8_e4m3": 32.0,  # 448 = 1.75·2^8, 3 mantissa bits
    "fp8_e5m2": 8192.0,  # 57344 = 1.75·2^15, 2 mantissa bits
}


def _flat_chunks(t: torch.Tensor) -> Iterator[torch.Tensor]:
    flat = t.reshape(-1)
    for i in range(0, flat.numel(), _CHUNK):
        yield flat[i:i + _CHUNK]


def theoretical_sqnr_db(bits: int) -> float:
    """SQNR of a uniform ``bits``-bit quantizer of a full-scale uniform signal: 6.02·b + 1.76 dB."""
    return 6.02 * bits + 1.76


def bits_per_weight(qt: QuantizedTensor) -> float:
    """Stored bits per element: codes, plus scales (in their dtype) and zero points (8 bits each)."""
    numel = max(1, math.prod(qt.shape))
    total = numel * DTYPES[qt.dtype].bits
    if qt.scale is not None:
        total += qt.scale.numel() * qt.scale.element_size() * 8
    if qt.zero_point is not None:
        total += qt.zero_point.numel() * ZERO_POINT_BITS
    return total / numel


def theoretical_max_error(qt: QuantizedTensor, absmax: float) -> float:
    """Half the largest quantization step; elements not clipped never exceed it.

    Integer dtypes: max(scale)/2. nf4: half the largest codebook gap × max(scale). fp8: half the
    step at the top of the fp8 range × max(scale). float16/bfloat16: half an ulp at ``absmax``.
    """
    info = DTYPES[qt.dtype]
    if info.kind == "float":
        finfo = torch.finfo(FLOAT_TORCH_DTYPES[qt.dtype])
        m = min(absmax, finfo.max)
        if m == 0.0:
            return 0.0
        exponent = max(math.frexp(m)[1] - 1, math.frexp(finfo.smallest_normal)[1] - 1)
        return math.ldexp(finfo.eps, exponent) / 2
    if qt.scale is None:
        raise ConfigError(f"{qt.dtype} codes need a scale", field="scale")
    max_scale = float(qt.scale.float().max())
    if info.kind == "nf4":
        gap = max(b - a for a, b in itertools.pairwise(NF4_CODEBOOK))
        return gap / 2 * max_scale
    if info.kind == "fp8":
        return _FP8_TOP_STEP[qt.dtype] / 2 * max_scale
    return max_scale / 2


def clipped_count(x: torch.Tensor, qt: QuantizedTensor) -> int:
    """Elements of ``x`` outside the range ``qt`` represents (the clamp moved them by more than
    half a step): integer ``x/scale + zp ∉ [qmin − ½, qmax + ½]``; nf4 ``|x/scale| > 1``; fp8
    ``|x/scale| > max_finite``; float casts ``|x| > max_finite``."""
    info = DTYPES[qt.dtype]
    if info.kind == "float":
        limit = torch.finfo(FLOAT_TORCH_DTYPES[qt.dtype]).max
        return sum(int((part.abs() > limit).sum().item()) for part in _flat_chunks(x))
    if qt.scale is None:
        raise ConfigError(f"{qt.dtype} codes need a scale", field="scale")
    blocks, _ = block_view(x, granularity_of_qt(qt), name="x")
    scale = qt.scale.reshape(-1, 1).float()
    zp = None if qt.zero_point is None else qt.zero_point.reshape(-1, 1).float()
    rows_per_chunk = max(1, _CHUNK // blocks.shape[1])
    count = 0
    for r in range(0, blocks.shape[0], rows_per_chunk):
        rs = slice(r, r + rows_per_chunk)
        q = blocks[rs].float() / scale[rs]
        if info.kind == "int":
            off = zp[rs] if zp is not None else torch.zeros_like(scale[rs])
            out = (q < info.qmin - 0.5 - off) | (q > info.qmax + 0.5 - off)
        else:
            out = q.abs() > (1.0 if info.kind == "nf4" else info.max_finite)
        count += int(out.sum())
    return count


@dataclass
class _Moments:
    """Running float64 sums over chunks of ``x`` and ``x_hat``."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0  # Σ (x − mean)²
    sum_x2: float = 0.0
    sum_h2: float = 0.0
    sum_xh: float = 0.0
    sum_e2: float = 0.0
    sum_abs_e: float = 0.0
    max_abs_e: float = 0.0
    max_abs_x: float = 0.0

    def add(self, xc: torch.Tensor, hc: torch.Tensor) -> None:
        n_c = xc.numel()
        mean_c = float(xc.mean())
        m2_c = float(((xc - mean_c) ** 2).sum())
        err = xc - hc
        delta = mean_c - self.mean
        total = self.n + n_c
        self.m2 += m2_c + delta * delta * self.n * n_c / total
        self.mean += delta * n_c / total
        self.n = total
        self.sum_x2 += float((xc * xc).sum())
        self.sum_h2 += float((hc * hc).sum())
        self.sum_xh += float((xc * hc).sum())
        abs_e = err.abs_()
        self.sum_e2 += float((abs_e * abs_e).sum())
        self.sum_abs_e += float(abs_e.sum())
        self.max_abs_e = max(self.max_abs_e, float(abs_e.max()))
        self.max_abs_x = max(self.max_abs_x, float(xc.abs().max()))


def _cosine(m: _Moments) -> float:
    if m.sum_x2 == 0.0 and m.sum_h2 == 0.0:
        return 1.0
    if m.sum_x2 == 0.0 or m.sum_h2 == 0.0:
        return 0.0
    return max(-1.0, min(1.0, m.sum_xh / math.sqrt(m.sum_x2 * m.sum_h2)))


def error_stats(x: torch.Tensor, x_hat: torch.Tensor, qt: QuantizedTensor) -> ErrorStats:
    """CONTRACT §4 statistics of ``x_hat`` (the dequantized ``qt``) against the original ``x``."""
    if tuple(x.shape) != tuple(x_hat.shape) or tuple(x.shape) != tuple(qt.shape):
        raise ConfigError(f"x {list(x.shape)}, x_hat {list(x_hat.shape)} and the quantized tensor "
                          f"{list(qt.shape)} must have one shape", field="x_hat")
    numel = x.numel()
    if numel == 0:
        raise ConfigError("statistics of an empty tensor are undefined", field="shape")
    m = _Moments()
    for xc, hc in zip(_flat_chunks(x), _flat_chunks(x_hat), strict=True):
        m.add(xc.double(), hc.double())
    std = math.sqrt(m.m2 / numel)
    threshold = OUTLIER_STDS * std
    outliers = sum(int(((xc.double() - m.mean).abs_() > threshold).sum().item()) for xc in _flat_chunks(x))
    mse = m.sum_e2 / numel
    signal = m.sum_x2 / numel
    if mse == 0.0:
        sqnr: float | None = None
    elif signal == 0.0:
        sqnr = -math.inf
    else:
        sqnr = 10.0 * math.log10(signal / mse)
    bpw = bits_per_weight(qt)
    info = DTYPES[qt.dtype]
    return ErrorStats(
        numel=numel,
        mse=mse,
        mae=m.sum_abs_e / numel,
        max_abs_error=m.max_abs_e,
        sqnr_db=sqnr,
        cosine=_cosine(m),
        outlier_rate=outliers / numel,
        outlier_threshold=threshold,
        clipped_fraction=clipped_count(x, qt) / numel,
        theoretical_max_error=theoretical_max_error(qt, m.max_abs_x),
        bits_per_weight=bpw,
        compression_ratio=torch.finfo(qt.orig_dtype).bits / bpw,
        theoretical_sqnr_db=theoretical_sqnr_db(info.bits) if info.kind == "int" else None,
    )
