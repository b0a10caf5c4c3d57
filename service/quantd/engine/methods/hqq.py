"""HQQ: half-quadratic optimisation of each block's zero point, data-free (Badri & Shaji, 2023).

With the scale ``s`` of the block's min-max range fixed, HQQ minimises ``‖W − Q⁻¹(Q(W))‖_p`` (``p < 1``:
a sparsity-promoting norm that lets a few large errors be) over the zero point ``z`` by alternating:

- ``W_q = clamp(round(W / s + z), 0, 2ᵇ − 1)``, ``W_r = (W_q − z) · s``;
- ``W_e = shrink_p(W − W_r, β)`` (generalised soft threshold: ``sign(e) · relu(|e| − |e|^(p−1) / β)``);
- ``z = mean(W_q − (W − W_e) / s)`` over the block, ``β ← κ β``.

Every block of the tensor is updated at once (the loop is over iterations, never blocks). Where the
reference (``hqq.core.optimize.optimize_weights_proximal_legacy``) stops the whole tensor at the first
iteration whose mean error grows and keeps the last zero point, each block here keeps the zero point of
its own lowest mean absolute error, and the loop ends when no block improves. The zero point stays a
float (``zero_point_domain = "float"``, stored in ``scale_dtype``); codes are computed from the stored
scale and zero point, so ``x̂ = (code − zero_point) · scale`` is what was optimised.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from quantd.engine import kernels
from quantd.engine.granularity import block_view, check_applicable, granularity_of, unblock
from quantd.engine.qparams import round_up_to, scale_torch_dtype, smallest_positive
from quantd.engine.types import QuantizedTensor
from quantd.errors import ConfigError, NonFiniteError
from quantd_client import Scheme
from quantd_client._dtypes import dtype_info

from ._common import check_integer_scheme
from .base import Arg, LayerHessian, Method, register

# Block rows per chunk: the iterations run over a chunk that stays in cache.
_CHUNK_ELEMENTS = 1 << 18


def _step(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, beta: torch.Tensor, levels: torch.Tensor,
          p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One half-quadratic iteration: the mean absolute error of ``zero`` and the next zero point, per row."""
    wq = torch.minimum(torch.round(w / scale + zero).clamp_min(0.0), levels)
    diff = w - (wq - zero) * scale
    a = diff.abs()
    we = torch.sign(diff) * torch.relu(a - a.clamp_min(1e-30).pow(p - 1.0) / beta)
    return a.mean(dim=1, keepdim=True), (wq - (w - we) / scale).mean(dim=1, keepdim=True)


def optimize_zero_point(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, *, levels: int, iters: int,
                        lp_norm: float, beta: float, kappa: float) -> torch.Tensor:
    """The optimised float zero point (offset domain: ``W_q ∈ [0, levels]``) of each row of ``w[B, K]``,
    given float32 ``scale[B, 1]`` and the initial ``zero[B, 1]``. On CPU each iteration is one fused
    compiled kernel when the compiled kernels are on (the same arithmetic as eager)."""
    best = zero.clone()
    best_err = torch.full_like(zero, float("inf"))
    dev = w.device
    lv, p = torch.tensor(float(levels), device=dev), torch.tensor(float(lp_norm), device=dev)
    compiled = kernels.KERNELS.wants(w)
    for _ in range(iters):
        b = torch.tensor(beta, device=dev)
        out = kernels.KERNELS.call("hqq_step", _step, (w.dtype,), w, scale, zero, b, lv, p) if compiled else None
        err, nxt = out if out is not None else _step(w, scale, zero, b, lv, p)
        better = err < best_err
        if not bool(better.any()):
            break
        best = torch.where(better, zero, best)
        best_err = torch.where(better, err, best_err)
        zero = nxt
        beta *= kappa
    return best


def _quantize(x: torch.Tensor, scheme: Scheme, args: Mapping[str, float | bool], calibration: LayerHessian | None,
              name: str) -> QuantizedTensor:
    info = dtype_info(scheme.dtype)
    gran = granularity_of(scheme)
    axis = check_applicable(tuple(x.shape), gran, name=name)
    blocks, sshape = block_view(x.float(), gran, name=name)
    if not bool(torch.isfinite(blocks).all()):
        raise NonFiniteError(f"tensor {name!r} has NaN or Inf values", tensor=name)
    sdt = scale_torch_dtype(scheme.scale_dtype)
    levels = info.qmax - info.qmin
    lo, hi = blocks.amin(dim=1, keepdim=True), blocks.amax(dim=1, keepdim=True)
    scale = round_up_to((hi.double() - lo.double()) / levels, sdt).clamp_min(smallest_positive(sdt))
    s32 = scale.float()
    codes = torch.empty(blocks.shape, dtype=torch.int8 if info.signed else torch.uint8, device=blocks.device)
    zp = torch.empty_like(s32)
    step = max(1, _CHUNK_ELEMENTS // blocks.shape[1])
    for r in range(0, blocks.shape[0], step):  # chunks of block rows, each all its iterations in cache
        w, s = blocks[r:r + step], s32[r:r + step]
        z = optimize_zero_point(w, s, -lo[r:r + step] / s, levels=levels, iters=int(args["iters"]),
                                lp_norm=float(args["lp_norm"]), beta=float(args["beta"]), kappa=float(args["kappa"]))
        z_stored = (z + info.qmin).to(sdt).float()  # the code domain, as stored
        zp[r:r + step] = z_stored
        codes[r:r + step] = torch.round(w / s + z_stored).clamp_(info.qmin, info.qmax).to(codes.dtype)

    return QuantizedTensor(
        codes=unblock(codes, tuple(x.shape), gran), scale=scale.to(sdt).reshape(sshape),
        zero_point=zp.to(sdt).reshape(sshape), shape=tuple(x.shape), dtype=scheme.dtype, orig_dtype=x.dtype,
        granularity=scheme.granularity, axis=axis, group_size=scheme.group_size, symmetric=False, method="hqq",
        observer=scheme.observer, zero_point_domain="float")


def _check(shape: tuple[int, ...], scheme: Scheme, args: Mapping[str, float | bool], name: str) -> None:
    check_integer_scheme(shape, scheme, "hqq", name)
    if scheme.symmetric:
        raise ConfigError("method 'hqq' optimises the zero point: use symmetric=false", field="scheme.symmetric",
                          tensor=name)


HQQ = register(Method(
    name="hqq", needs="none", quantize=_quantize, check=_check,
    zero_point_domain=lambda scheme, args: "float",
    description="half-quadratic optimisation of each block's float zero point (data-free; integer affine, "
                "per channel or group)",
    args=(
        Arg("iters", "int", 20, "most iterations (the loop ends when no block improves)", 1, 1000),
        Arg("lp_norm", "float", 0.7, "p of the ‖W − Ŵ‖_p the zero points minimise", 0.1, 1.0),
        Arg("beta", "float", 10.0, "initial weight of the quadratic coupling term", 1e-3, 1e6),
        Arg("kappa", "float", 1.01, "growth of beta per iteration", 1.0, 2.0),
    )))
