"""Typed engine results."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantizedTensor:
    """One quantized tensor, unpacked.

    ``codes``: integer dtypes → int16/int32/uint8/int8 tensor of the ORIGINAL shape with values in
    ``[qmin, qmax]``; nf4 → uint8 codebook indices 0…15, original shape; fp8 → float8 tensor
    (``x / scale`` cast), original shape; float16/bfloat16 → the cast tensor, original shape.
    ``scale``/``zero_point`` have the CONTRACT §5 shapes (channel ``[shape[axis]]``, group
    ``[rows, cols // group_size]``, tensor ``[]``), ``scale`` in ``scale_dtype``; ``zero_point``
    is None when symmetric, else integers in the code domain (int8 storage for signed dtypes,
    uint8 for unsigned). Dequantization: ``x̂ = (code − zero_point) · scale`` (nf4:
    ``codebook[code] · scale``; fp8: ``code.float() · scale``).

    Methods beyond round-to-nearest (CONTRACT §10) may add: ``zero_point_domain == "float"`` (HQQ:
    ``zero_point`` is a float tensor in ``scale``'s dtype, same formula); ``g_idx`` (int32 ``[cols]`` of the
    ``[rows, cols]`` view: column ``j`` uses group ``g_idx[j]``'s scale and zero point, GPTQ act-order);
    ``channel_scale`` (float32 ``[cols]``, AWQ scales not folded into a preceding layer: column ``j`` of
    ``x̂`` is divided by ``channel_scale[j]``).
    """

    codes: torch.Tensor
    scale: torch.Tensor | None
    zero_point: torch.Tensor | None
    shape: tuple[int, ...]
    dtype: str  # quantd dtype name, e.g. "int4"
    orig_dtype: torch.dtype
    granularity: str  # tensor | channel | group
    axis: int
    group_size: int
    symmetric: bool
    method: str = "rtn"
    observer: str = "minmax"
    zero_point_domain: str = "int"  # int | float
    g_idx: torch.Tensor | None = None
    channel_scale: torch.Tensor | None = None
