"""Round to nearest: the range of each block from the scheme's observer, every element rounded on its own
(:func:`quantd.engine.primitives.quantize`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from quantd.engine import primitives
from quantd.engine.types import QuantizedTensor
from quantd_client import Scheme

from .base import LayerHessian, Method, register


def _quantize(x: torch.Tensor, scheme: Scheme, args: Mapping[str, float | bool], calibration: LayerHessian | None,
              name: str) -> QuantizedTensor:
    return primitives.quantize(x, scheme, name=name)  # looked up at call time: one quantize for every caller


RTN = register(Method(
    name="rtn", needs="none", args=(), quantize=_quantize,
    description="round to nearest in the range the scheme's observer picks (every dtype and granularity)"))
