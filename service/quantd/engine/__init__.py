"""The quantization engine: pure torch functions on tensors (no HTTP, no files, no database).

The core (granularity, qparams, primitives, packing, stats) is imported eagerly; observers,
calibration, analysis, qat and qlinear are imported on first access, so importing ``quantd.engine``
stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

from quantd.engine.granularity import (
    Granularity,
    PerChannel,
    PerGroup,
    PerTensor,
    block_view,
    granularity_of,
    scale_shape,
    unblock,
)
from quantd.engine.packing import PACKERS, pack, packed_nbytes, unpack
from quantd.engine.primitives import dequantize, fake_quantize, quantize
from quantd.engine.qparams import choose_qparams
from quantd.engine.stats import bits_per_weight, error_stats, theoretical_max_error, theoretical_sqnr_db
from quantd.engine.types import QuantizedTensor

_LAZY: dict[str, str] = {
    "observe_range": "quantd.engine.observers",
    "ActivationObserver": "quantd.engine.observers",
    "calibrate_layers": "quantd.engine.calibration",
    "compare_bit_widths": "quantd.engine.analysis",
    "outlier_impact": "quantd.engine.analysis",
    "scale_sensitivity": "quantd.engine.analysis",
    "QuantizedLinear": "quantd.engine.qlinear",
}

__all__ = [
    "PACKERS",
    "ActivationObserver",
    "Granularity",
    "PerChannel",
    "PerGroup",
    "PerTensor",
    "QuantizedLinear",
    "QuantizedTensor",
    "bits_per_weight",
    "block_view",
    "calibrate_layers",
    "choose_qparams",
    "compare_bit_widths",
    "dequantize",
    "error_stats",
    "fake_quantize",
    "granularity_of",
    "observe_range",
    "outlier_impact",
    "pack",
    "packed_nbytes",
    "quantize",
    "scale_sensitivity",
    "scale_shape",
    "theoretical_max_error",
    "theoretical_sqnr_db",
    "unblock",
    "unpack",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'quantd.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
