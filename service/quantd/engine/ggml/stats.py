"""Error statistics (CONTRACT §4) of a tensor quantized to a ggml type, measured on ggml's own decode.

``theoretical_max_error`` is null: ggml's steps differ per (sub-)block and its k-quant searches trade a
clipped extreme for a finer grid, so no single half-step bounds the error. ``clipped_fraction`` counts the
elements outside the range their block's decoded values span (what the block's grid does not reach).
"""

from __future__ import annotations

import math

import torch

from quantd.engine import kernels
from quantd.engine.stats import OUTLIER_STDS, moments, outlier_count
from quantd.errors import MalformedInputError
from quantd_client import ErrorStats

from . import CHUNK_ELEMENTS, GGMLQuantized, dequantize, map_chunks


def ggml_error_stats(x: torch.Tensor, q: GGMLQuantized, *, in_bits: int, name: str = "tensor") -> ErrorStats:
    """Statistics of ``dequantize(q)`` against ``x`` (its input): the engine's float64 moments and outlier
    count (:func:`quantd.engine.stats.moments`, one fused pass where the compiled kernels run) and the clipped
    count against each block's decoded range. MalformedInputError naming the tensor when its values are beyond
    what the type's float16 scales hold (the decode is not finite: ggml would store an infinite scale)."""
    t = q.ggml_type
    n = x.shape[-1]
    rows = x.numel() // n
    x2 = x.reshape(rows, n)
    x_hat = dequantize(q).reshape(rows, n)
    m = moments(x2, x_hat)
    if not (math.isfinite(m.sum_e2) and math.isfinite(m.max_abs_e)):
        amax = float(x.abs().max())
        raise MalformedInputError(f"tensor {name!r}: values up to {amax:.4g} are beyond the range of {t.name}'s "
                                  "float16 scales (they would decode as Inf or NaN)", tensor=name)
    nclip = _clipped_count(x2.reshape(-1, t.block_size), x_hat.reshape(-1, t.block_size))
    numel = rows * n
    threshold = OUTLIER_STDS * math.sqrt(m.m2 / numel)
    outliers = outlier_count(x2, m.mean, threshold)
    mse = m.sum_e2 / numel
    signal = m.sum_x2 / numel
    denom = math.sqrt(m.sum_x2 * m.sum_h2)
    return ErrorStats(
        numel=numel, mse=mse, mae=m.sum_abs_e / numel, max_abs_error=m.max_abs_e,
        sqnr_db=10 * math.log10(signal / mse) if mse > 0 and signal > 0 else None,
        cosine=m.sum_xh / denom if denom > 0 else 1.0,
        outlier_rate=outliers / numel, outlier_threshold=threshold,
        clipped_fraction=nclip / numel, theoretical_max_error=None,
        bits_per_weight=t.bits_per_weight, compression_ratio=in_bits / t.bits_per_weight,
    )


def clipped_in_blocks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many elements of the blocks ``a`` ``[B, size]`` lie outside the range of their block of ``b``
    (float32 comparisons: exact)."""
    return ((a < b.amin(1, keepdim=True)) | (a > b.amax(1, keepdim=True))).sum()


def _clipped_count(a: torch.Tensor, b: torch.Tensor) -> int:
    """:func:`clipped_in_blocks` over all blocks: one compiled pass where the kernels run, else in chunks on
    the chunk threads."""
    if kernels.KERNELS.wants(a, cuda=False):
        torch._dynamo.mark_static(a, 1)
        torch._dynamo.mark_static(b, 1)
        out = kernels.KERNELS.call("ggml_clipped", clipped_in_blocks, (a.shape[1],), a, b)
        if out is not None:
            return int(out)
    step = max(1, CHUNK_ELEMENTS // a.shape[1])
    starts = range(0, a.shape[0], step)
    return int(torch.stack(map_chunks(lambda r0: clipped_in_blocks(a[r0:r0 + step], b[r0:r0 + step]), starts,
                                      a.device)).sum())
