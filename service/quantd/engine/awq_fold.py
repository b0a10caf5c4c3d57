"""AWQ with its per-input-channel scales folded into the model (model-aware calibration, CONTRACT §10).

When a Linear's input is the output of a layer that is linear per channel (a norm's weight, or a Linear
whose output reaches it through operations linear in it: attention's ``V`` → output projection, ``up`` →
``down`` in a gated MLP), dividing that layer's output channels by ``s`` and multiplying the consumers'
input columns by ``s`` leaves the model's function unchanged. The scales then need no ``channel_scale``:
the consumers' weights ``W·s`` are quantized as they are. Every consumer of one source shares its ``s``,
so ``s`` is searched jointly: the consumers' ``[out, in]`` weights stacked along the rows share one input
Hessian, and the stacked output error is the sum of theirs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from quantd.engine.granularity import block_view, granularity_of
from quantd.engine.methods.awq import awq_clip, awq_scales
from quantd.engine.observers import observe_range
from quantd.engine.primitives import quantize
from quantd.engine.types import QuantizedTensor
from quantd_client import Scheme


def joint_scales(weights: Sequence[torch.Tensor], h: torch.Tensor, count: int, scheme: Scheme, *,
                 args: Mapping[str, float | bool], name: str) -> torch.Tensor:
    """The scales ``s[in]`` (float32) of least summed output error over the consumers ``weights`` (each
    ``[out_i, in]``, float32) of one input whose Hessian is ``h`` over ``count`` rows."""
    stacked = torch.cat([w.float() for w in weights], dim=0)
    return awq_scales(stacked, h.float(), count, scheme, grid=int(args["grid"]),
                      duo_scaling=bool(args["duo_scaling"]), name=name)


def quantize_folded(w: torch.Tensor, h: torch.Tensor, scheme: Scheme, *, args: Mapping[str, float | bool],
                    name: str, orig_dtype: torch.dtype) -> QuantizedTensor:
    """AWQ's quantization of a weight whose scales are already folded in (``w`` is ``W·s``, ``h`` the
    Hessian of its folded inputs): each group's clipping ratio searched as AWQ does, then rounded to
    nearest; the result has no ``channel_scale``."""
    w = w.float()
    rtn = scheme.model_copy(update={"method": "rtn", "method_args": {}})
    lo_hi = None
    if bool(args["clip"]):
        ratio = awq_clip(w, torch.ones(w.shape[1], device=w.device), h.float(), scheme, grid=int(args["grid"]),
                         max_shrink=float(args["max_shrink"]), name=name)
        lo, hi = observe_range(block_view(w, granularity_of(scheme), name=name)[0], scheme, name=name)
        lo_hi = (lo * ratio, hi * ratio)
    qt = quantize(w, rtn, name=name, observer_range=lo_hi)
    return QuantizedTensor(
        codes=qt.codes, scale=qt.scale, zero_point=qt.zero_point, shape=qt.shape, dtype=qt.dtype,
        orig_dtype=orig_dtype, granularity=qt.granularity, axis=qt.axis, group_size=qt.group_size,
        symmetric=qt.symmetric, method="awq", observer=scheme.observer)
