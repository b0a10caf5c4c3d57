"""Error statistics (CONTRACT §4) of a tensor quantized to a ggml type, measured on ggml's own decode.

``theoretical_max_error`` is null: ggml's steps differ per (sub-)block and its k-quant searches trade a
clipped extreme for a finer grid, so no single half-step bounds the error. ``clipped_fraction`` counts the
elements outside the range their block's decoded values span (what the block's grid does not reach).
"""

from __future__ import annotations

import math

import torch

from quantd.errors import MalformedInputError
from quantd_client import ErrorStats

from . import CHUNK_ELEMENTS, GGMLQuantized, dequantize, map_chunks

OUTLIER_STDS = 3.0


def ggml_error_stats(x: torch.Tensor, q: GGMLQuantized, *, in_bits: int, name: str = "tensor") -> ErrorStats:
    """Statistics of ``dequantize(q)`` against ``x`` (its input), in float64 sums over chunks of rows.
    MalformedInputError naming the tensor when its values are beyond what the type's float16 scales hold
    (the decode is not finite: ggml would store an infinite scale)."""
    t = q.ggml_type
    n = x.shape[-1]
    rows = x.numel() // n
    x2 = x.reshape(rows, n)
    x_hat = dequantize(q).reshape(rows, n)
    step = max(1, CHUNK_ELEMENTS // n)
    starts = range(0, rows, step)

    def moments(r0: int) -> torch.Tensor:  # Σx, Σx², Σe², Σ|e|, Σx̂², Σxx̂, clipped, max|e|
        # The clipped count compares the float32 values themselves (exact); the sums run in float64, the
        # squares and products as dot products (one pass each, no temporaries).
        blocks_a = x2[r0:r0 + step].reshape(-1, t.block_size)
        blocks_b = x_hat[r0:r0 + step].reshape(-1, t.block_size)
        lo = blocks_b.amin(1, keepdim=True)
        hi = blocks_b.amax(1, keepdim=True)
        clipped = ((blocks_a < lo) | (blocks_a > hi)).sum()
        a = blocks_a.reshape(-1).double()
        b = blocks_b.reshape(-1).double()
        e = b - a
        abs_e = e.abs()
        return torch.stack([a.sum(), torch.dot(a, a), torch.dot(e, e), abs_e.sum(), torch.dot(b, b), torch.dot(a, b),
                            clipped.double(), abs_e.max()])

    parts = torch.stack(map_chunks(moments, starts, x.device))
    sx, sx2, se2, sae, sb2, sab, nclip = parts[:, :7].sum(0).tolist()
    max_err = float(parts[:, 7].max())
    if not (math.isfinite(se2) and math.isfinite(max_err)):
        amax = float(x.abs().max())
        raise MalformedInputError(f"tensor {name!r}: values up to {amax:.4g} are beyond the range of {t.name}'s "
                                  "float16 scales (they would decode as Inf or NaN)", tensor=name)
    numel = rows * n
    mean = sx / numel
    var = max(sx2 / numel - mean * mean, 0.0)
    threshold = OUTLIER_STDS * math.sqrt(var)
    outliers = sum(map_chunks(lambda r0: int(((x2[r0:r0 + step].double() - mean).abs() > threshold).sum()),
                              starts, x.device))
    mse = se2 / numel
    signal = sx2 / numel
    denom = math.sqrt(sx2 * sb2)
    return ErrorStats(
        numel=numel, mse=mse, mae=sae / numel, max_abs_error=max_err,
        sqnr_db=10 * math.log10(signal / mse) if mse > 0 and signal > 0 else None,
        cosine=sab / denom if denom > 0 else 1.0,
        outlier_rate=outliers / numel, outlier_threshold=threshold,
        clipped_fraction=nclip / numel, theoretical_max_error=None,
        bits_per_weight=t.bits_per_weight, compression_ratio=in_bits / t.bits_per_weight,
    )
