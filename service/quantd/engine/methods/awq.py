"""AWQ: per-input-channel scales that protect the channels with large activations, searched to minimise
the layer's output error, then a per-group clipping search (Lin et al., 2023).

The output error of a weight ``Ŵ`` is measured exactly from the inputs' second moment:
``‖X Wᵀ − X Ŵᵀ‖² = tr(ΔW H ΔWᵀ)`` with ``H = Σ x xᵀ``, so no input rows need to be kept. Scales:
``s = a^α / w^(1−α)`` (``a`` the inputs' RMS per channel, ``√(H_jj / N)``; ``w`` the mean of ``|W|``
normalised per group, per column), normalised to ``√(max s · min s) = 1``, for ``α`` on a grid of
``grid`` points in ``[0, 1)``; ``W·s`` is quantized and ``Ŵ = Q(W·s) / s``. Then each group's range is
shrunk by the ratio (1 down to ``1 − max_shrink``) whose output error through the group's own block of ``H``
is least. Without a graph to fold ``s`` into the preceding layer, ``s`` is stored as ``channel_scale``
(dequantization divides column ``j`` by ``s_j``). Every candidate is evaluated for the whole matrix at once.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from quantd.engine.granularity import block_view, granularity_of
from quantd.engine.observers import observe_range
from quantd.engine.primitives import dequantize, quantize
from quantd.engine.types import QuantizedTensor
from quantd.errors import ConfigError
from quantd_client import Scheme

from ._common import check_linear_weight, group_columns
from .base import Arg, LayerHessian, Method, register


def output_error(dw: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``tr(ΔW H ΔWᵀ)`` (float64 scalar) for ``ΔW[out, in]`` and symmetric ``H[in, in]``."""
    return ((dw @ h) * dw).sum(dtype=torch.float64)


def _group_error(dw: torch.Tensor, h_blocks: torch.Tensor, gs: int) -> torch.Tensor:
    """Per row and group, ``ΔW_g H_gg ΔW_gᵀ``: ``[out, G]``."""
    d = dw.reshape(dw.shape[0], -1, gs)
    return torch.einsum("rgi,gij,rgj->rg", d, h_blocks, d)


def _rtn(w: torch.Tensor, scheme: Scheme, name: str, ratio: torch.Tensor | None = None) -> QuantizedTensor:
    """Round to nearest of ``w``, each block's observed range multiplied by ``ratio`` (per block) if given."""
    rtn = scheme.model_copy(update={"method": "rtn"})
    if ratio is None:
        return quantize(w, rtn, name=name)
    lo, hi = observe_range(block_view(w, granularity_of(scheme), name=name)[0], scheme, name=name)
    return quantize(w, rtn, name=name, observer_range=(lo * ratio, hi * ratio))


def awq_scales(w: torch.Tensor, h: torch.Tensor, count: int, scheme: Scheme, *, grid: int, duo_scaling: bool,
               name: str) -> torch.Tensor:
    """The per-input-channel scales ``s[in]`` (float32) of least output error over the ``α`` grid."""
    gs = group_columns(w.shape[1], scheme)
    x_rms = (torch.diagonal(h).clamp_min(0) / max(count, 1)).sqrt()
    wn = w.abs().reshape(w.shape[0], -1, gs)
    wn = (wn / wn.amax(dim=2, keepdim=True).clamp_min(1e-12)).reshape(w.shape)
    w_mean = wn.mean(dim=0)
    best, best_err = torch.ones_like(x_rms), float("inf")
    for k in range(grid):  # a handful of candidates, each evaluated on the whole matrix
        alpha = k / grid
        s = x_rms.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4) if duo_scaling else x_rms.pow(alpha)
        s = s.clamp_min(1e-4)
        s = s / (s.max() * s.min()).sqrt()
        w_hat = dequantize(_rtn(w * s, scheme, name)) / s
        err = float(output_error(w_hat - w, h))
        if err < best_err:
            best, best_err = s, err
    return best


def awq_clip(ws: torch.Tensor, s: torch.Tensor, h: torch.Tensor, scheme: Scheme, *, grid: int, max_shrink: float,
             name: str) -> torch.Tensor:
    """Per block of ``ws = W·s``, the range ratio in ``(1 − max_shrink, 1]`` of least output error."""
    gs = group_columns(ws.shape[1], scheme)
    n_groups = ws.shape[1] // gs
    # the error of Ŵ = Q(W·s)/s is measured on W·s with H scaled by 1/s on both sides
    hs = h / s.unsqueeze(0) / s.unsqueeze(1)
    idx = torch.arange(n_groups, device=ws.device)
    h_blocks = hs.reshape(n_groups, gs, n_groups, gs)[idx, :, idx, :]
    best_ratio = torch.ones(ws.shape[0], n_groups, device=ws.device)
    best_err = torch.full_like(best_ratio, float("inf"))
    for k in range(max(1, int(max_shrink * grid))):
        r = 1.0 - k / grid
        ratio = torch.full((ws.shape[0] * n_groups,), r, device=ws.device)
        err = _group_error(dequantize(_rtn(ws, scheme, name, ratio)) - ws, h_blocks, gs)
        better = err < best_err
        best_ratio = torch.where(better, r, best_ratio)
        best_err = torch.where(better, err, best_err)
    return best_ratio.reshape(-1)


def _quantize(x: torch.Tensor, scheme: Scheme, args: Mapping[str, float | bool], calibration: LayerHessian | None,
              name: str) -> QuantizedTensor:
    if calibration is None:
        raise ConfigError("method 'awq' needs calibration for this tensor", field="calibration", tensor=name)
    w = x.float()
    h = calibration.hessian.float()
    grid = int(args["grid"])
    s = awq_scales(w, h, calibration.count, scheme, grid=grid, duo_scaling=bool(args["duo_scaling"]), name=name)
    ws = w * s
    ratio = None
    if bool(args["clip"]):
        ratio = awq_clip(ws, s, h, scheme, grid=grid, max_shrink=float(args["max_shrink"]), name=name)
    qt = _rtn(ws, scheme, name, ratio)
    return QuantizedTensor(
        codes=qt.codes, scale=qt.scale, zero_point=qt.zero_point, shape=qt.shape, dtype=qt.dtype,
        orig_dtype=x.dtype, granularity=qt.granularity, axis=qt.axis, group_size=qt.group_size,
        symmetric=qt.symmetric, method="awq", observer=scheme.observer, channel_scale=s.float())


def _check(shape: tuple[int, ...], scheme: Scheme, args: Mapping[str, float | bool], name: str) -> None:
    check_linear_weight(shape, scheme, "awq", name)


AWQ = register(Method(
    name="awq", needs="hessian", quantize=_quantize, check=_check,
    uses_channel_scale=lambda scheme, args: True,
    description="AWQ: per-input-channel scales and per-group clipping searched for the least layer output "
                "error (needs calibration; 2-D Linear weights, integer, per channel or group; the scales are "
                "stored as channel_scale)",
    args=(
        Arg("grid", "int", 20, "candidates of the scale exponent α in [0, 1), and the clipping grid", 1, 200),
        Arg("duo_scaling", "bool", True, "divide the activation scales by the weights' mean magnitude^(1−α)"),
        Arg("clip", "bool", True, "search each group's clipping ratio"),
        Arg("max_shrink", "float", 0.5, "the most a group's range is shrunk by the clipping search", 0.0, 0.9),
    )))
