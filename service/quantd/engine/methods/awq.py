"""AWQ: per-input-channel scales that protect the channels with large activations, searched to minimise
the layer's output error, then a per-group clipping search (Lin et al., 2023).

The output error of a weight ``Ŵ`` is measured exactly from the inputs' second moment:
``‖X Wᵀ − X Ŵᵀ‖² = tr(ΔW H ΔWᵀ)`` with ``H = Σ x xᵀ``, so no input rows need to be kept. Scales:
``s = a^α / w^(1−α)`` (``a`` the inputs' RMS per channel, ``√(H_jj / N)``; ``w`` the mean of ``|W|``
normalised per group, per column), normalised to ``√(max s · min s) = 1``, for ``α`` on a grid of
``grid`` points in ``[0, 1)``; ``W·s`` is quantized and ``Ŵ = Q(W·s) / s``. Then each group's range is
shrunk by the ratio (1 down to ``1 − max_shrink``) whose output error through the group's own block of ``H``
is least. Without a graph to fold ``s`` into the preceding layer, ``s`` is stored as ``channel_scale``
(dequantization divides column ``j`` by ``s_j``). Every candidate is evaluated for the whole matrix at once;
the scale candidates together, in stacks, their errors as ``‖ΔW L‖²`` through the Cholesky factor ``H = L Lᵀ``
(half the multiply-adds of ``ΔW H``, the zero half of ``L`` skipped by column blocks).
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


# The α candidates evaluated in one stack ``[k, out, in]`` hold at most this many float32 elements (16 MiB) unless
# one candidate alone is larger: the search's memory stays a few times the weight's, and a stack's passes
# reuse the same (cached) memory instead of touching new pages for every candidate.
STACK_ELEMENTS = 1 << 22


def error_factor(h: torch.Tensor) -> torch.Tensor | None:
    """The lower Cholesky factor ``L`` of ``H = L Lᵀ``, so that ``tr(ΔW H ΔWᵀ) = ‖ΔW L‖²``; None when ``H`` is
    not positive definite in float32 (dead inputs, no damping)."""
    chol: torch.Tensor
    chol, info = torch.linalg.cholesky_ex(h)
    if int(info) != 0 or not bool(torch.isfinite(chol).all()):
        return None
    return chol


def _row_errors(dw: torch.Tensor, h: torch.Tensor, chol: torch.Tensor | None, k: int) -> torch.Tensor:
    """``tr(ΔW_i H ΔW_iᵀ)`` (float64 ``[k]``) for ``dw`` the ``k`` stacked ``ΔW_i`` ``[k·out, in]``.

    With ``L`` the product ``ΔW L`` is taken by column blocks of ``L``, each against the rows of ``L`` from
    the block's first on (the rest are zero): about ``(b + 1) / 2b`` of a full ``ΔW H`` for ``b`` blocks."""
    if chol is None:
        return ((dw @ h) * dw).reshape(k, -1).sum(dim=1, dtype=torch.float64)
    cols = dw.shape[1]
    width = max(64, -(-cols // 16))  # narrower blocks skip more of L's zero half, wider ones multiply faster
    err = torch.zeros(k, dtype=torch.float64, device=dw.device)
    for c0 in range(0, cols, width):  # at most 16 column blocks, each one matmul over every candidate
        c1 = min(c0 + width, cols)
        y = dw[:, c0:] @ chol[c0:, c0:c1]
        err += y.square_().sum(dim=1).reshape(k, -1).sum(dim=1, dtype=torch.float64)
    return err


def awq_scales(w: torch.Tensor, h: torch.Tensor, count: int, scheme: Scheme, *, grid: int, duo_scaling: bool,
               name: str) -> torch.Tensor:
    """The per-input-channel scales ``s[in]`` (float32) of least output error over the ``α`` grid.

    Every candidate's ``s`` is formed at once (``[grid, in]``); the candidates are quantized and their errors
    measured in stacks of rows (per channel and per group the blocks lie within a row, so a stack
    quantizes each candidate as it would alone), through ``H``'s Cholesky factor when it has one. The first
    candidate of least error wins, as in a loop over ``α``."""
    gs = group_columns(w.shape[1], scheme)
    x_rms = (torch.diagonal(h).clamp_min(0) / max(count, 1)).sqrt()
    wn = w.abs().reshape(w.shape[0], -1, gs)
    wn = (wn / wn.amax(dim=2, keepdim=True).clamp_min(1e-12)).reshape(w.shape)
    w_mean = wn.mean(dim=0)
    alpha = (torch.arange(grid, device=w.device, dtype=torch.float32) / grid).unsqueeze(1)
    s_all = x_rms.pow(alpha)
    if duo_scaling:
        s_all = s_all / (w_mean.pow(1 - alpha) + 1e-4)
    s_all = s_all.clamp_min(1e-4)
    s_all = s_all / (s_all.amax(dim=1, keepdim=True) * s_all.amin(dim=1, keepdim=True)).sqrt()
    chol = error_factor(h)
    per_stack = max(1, STACK_ELEMENTS // w.numel()) if scheme.granularity in ("channel", "group") else 1
    errs = []
    for k0 in range(0, grid, per_stack):  # one stack when memory allows
        s = s_all[k0:k0 + per_stack].unsqueeze(1)
        ws = (w * s).reshape(-1, w.shape[1])
        dw = dequantize(_rtn(ws, scheme, name))
        dw.view(s.shape[0], *w.shape).div_(s).sub_(w)
        errs.append(_row_errors(dw, h, chol, s.shape[0]))
    err = torch.cat(errs).nan_to_num(nan=float("inf"))
    best = int(torch.argmin(err))
    if not bool(torch.isfinite(err[best])):
        return torch.ones_like(x_rms)
    return s_all[best].contiguous()


def awq_clip(ws: torch.Tensor, s: torch.Tensor, h: torch.Tensor, scheme: Scheme, *, grid: int, max_shrink: float,
             name: str) -> torch.Tensor:
    """Per block of ``ws = W·s``, the range ratio in ``(1 − max_shrink, 1]`` of least output error."""
    gs = group_columns(ws.shape[1], scheme)
    n_groups = ws.shape[1] // gs
    # the error of Ŵ = Q(W·s)/s is measured on W·s with H scaled by 1/s on both sides
    hs = h / s.unsqueeze(0) / s.unsqueeze(1)
    idx = torch.arange(n_groups, device=ws.device)
    h_blocks = hs.reshape(n_groups, gs, n_groups, gs)[idx, :, idx, :]
    # every ratio at once, in stacks of candidates like awq_scales' (the blocks lie within rows)
    ratios = (1.0 - torch.arange(max(1, int(max_shrink * grid)), dtype=torch.float64, device=ws.device) / grid).float()
    per_stack = max(1, STACK_ELEMENTS // ws.numel())
    errs = []
    for k0 in range(0, ratios.numel(), per_stack):
        r = ratios[k0:k0 + per_stack]
        stack = ws.unsqueeze(0).expand(r.numel(), -1, -1).reshape(-1, ws.shape[1])
        ratio = r.repeat_interleave(ws.shape[0] * n_groups)
        dq = dequantize(_rtn(stack, scheme, name, ratio)).sub_(stack)
        errs.append(_group_error(dq, h_blocks, gs).reshape(r.numel(), ws.shape[0], n_groups))
    # the first ratio of least error per block; ratio 1 (the first) where every error is NaN or infinite
    best = torch.argmin(torch.cat(errs).nan_to_num(nan=float("inf")), dim=0)
    return ratios[best].reshape(-1)


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
