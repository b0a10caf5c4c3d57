"""HQQ: half-quadratic optimisation of each block's zero point, data-free (Badri & Shaji, 2023).

With the block's scale ``s`` fixed, HQQ minimises ``‖W − Q⁻¹(Q(W))‖_p`` (``p < 1``: a sparsity-promoting
norm that lets a few large errors be) over the zero point ``z`` by alternating:

- ``W_q = clamp(round(W / s + z), 0, 2ᵇ − 1)``, ``W_r = (W_q − z) · s``;
- ``W_e = shrink_p(W − W_r, β)`` (generalised soft threshold: ``sign(e) · relu(|e| − |e|^(p−1) / β)``);
- ``z = mean(W_q − (W − W_e) / s)`` over the block, ``β ← κ β``.

The reference (``hqq.core.quantize.Quantizer`` with ``optimize_weights_proximal_legacy``) starts from the
block's min-max range and stops the whole tensor at the first iteration whose mean error grows. Here the
range is first shrunk, per block, by the ratio in ``[1 − max_shrink, 1]`` (``grid`` candidates) of least
squared rounding error, and the iterations then run a fixed ``iters`` times with each block keeping the zero
point of its own lowest mean absolute error: a better start, and no block stopped by the others. Every
block of the tensor is updated at once (chunks of block rows that stay in cache; the loops are over
candidates and iterations, never blocks), and on CPU the whole search of a chunk is one compiled graph
when the compiled kernels are on (the same arithmetic as eager). The zero point stays a float
(``zero_point_domain = "float"``, stored in ``scale_dtype``); codes are computed from the stored scale and
zero point, so ``x̂ = (code − zero_point) · scale`` is what was optimised.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

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

# Block rows per chunk: a chunk's candidates and iterations run while it stays in cache.
_CHUNK_ELEMENTS = 1 << 18

HqqBlocksFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                       tuple[torch.Tensor, torch.Tensor]]


def _step(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, beta: torch.Tensor, levels: torch.Tensor,
          p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One half-quadratic iteration: the mean absolute error of ``zero`` and the next zero point, per row."""
    wq = torch.minimum(torch.round(w / scale + zero).clamp_min(0.0), levels)
    diff = w - (wq - zero) * scale
    a = diff.abs()
    we = torch.sign(diff) * torch.relu(a - a.clamp_min(1e-30).pow(p - 1.0) / beta)
    return a.mean(dim=1, keepdim=True), (wq - (w - we) / scale).mean(dim=1, keepdim=True)


def _iterate(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, betas: torch.Tensor, levels: torch.Tensor,
             p: torch.Tensor, iters: int) -> torch.Tensor:
    """The zero point of least mean absolute error, per row, among the ``iters`` iterates from ``zero``."""
    best, best_err = zero, torch.full_like(zero, float("inf"))
    for t in range(iters):
        err, nxt = _step(w, scale, zero, betas[t], levels, p)
        better = err < best_err
        best = torch.where(better, zero, best)
        best_err = torch.where(better, err, best_err)
        zero = nxt
    return best


def _pick_range(w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, ratios: torch.Tensor, levels: torch.Tensor,
                scale_dtype: torch.dtype, smallest: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``w[B, K]``, the scale (rounded up to ``scale_dtype``, as float32) and offset-domain zero
    point of the range ``[lo, hi]·r`` (``r`` in ``ratios[C]``) of least squared rounding error: ``[B, 1]`` each."""
    r = ratios.view(-1, 1, 1)
    scales = round_up_to((hi - lo) * r / levels, scale_dtype).float().clamp_min(smallest)  # [C, B, 1]
    zeros = -lo * r / scales
    wq = torch.minimum(torch.round(w / scales + zeros).clamp_min(0.0), levels)
    err = ((wq - zeros) * scales - w).square().sum(dim=2)  # [C, B]
    idx = err.argmin(dim=0).view(1, -1, 1)
    return scales.gather(0, idx).squeeze(0), zeros.gather(0, idx).squeeze(0)


@functools.cache
def _blocks_fn(iters: int, scale_dtype: torch.dtype) -> HqqBlocksFn:
    """The search of a chunk of blocks (one function per iteration count and scale dtype, so that a compiled
    graph unrolls a fixed loop): the range search and the iterations. Returns the scale (float32 values of
    ``scale_dtype``) and the offset-domain zero point (float32, before its rounding to ``scale_dtype``, which
    the caller does eagerly: a fused kernel may keep a cast's float32 value)."""
    smallest = smallest_positive(scale_dtype)

    def hqq_blocks(w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, ratios: torch.Tensor, betas: torch.Tensor,
                   consts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        levels, p = consts[0], consts[1]
        scale, zero = _pick_range(w, lo, hi, ratios, levels, scale_dtype, smallest)
        return scale, _iterate(w, scale, zero, betas, levels, p, iters)

    return hqq_blocks


def optimize_zero_point(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, *, levels: int, iters: int,
                        lp_norm: float, beta: float, kappa: float) -> torch.Tensor:
    """The optimised float zero point (offset domain: ``W_q ∈ [0, levels]``) of each row of ``w[B, K]``,
    given float32 ``scale[B, 1]`` and the initial ``zero[B, 1]``: the best of ``iters`` iterates, per row."""
    dev = w.device
    betas = beta * kappa ** torch.arange(iters, device=dev, dtype=torch.float64)
    return _iterate(w, scale, zero, betas.float(), torch.tensor(float(levels), device=dev),
                    torch.tensor(float(lp_norm), device=dev), iters)


def shrink_ratios(max_shrink: float, grid: int, device: torch.device) -> torch.Tensor:
    """The range ratios searched: ``grid + 1`` from 1 down to ``1 − max_shrink`` (1 alone when either is 0)."""
    n = grid + 1 if max_shrink > 0 and grid > 0 else 1
    return torch.linspace(1.0, 1.0 - max_shrink, n, device=device)


def _quantize(x: torch.Tensor, scheme: Scheme, args: Mapping[str, float | bool], calibration: LayerHessian | None,
              name: str) -> QuantizedTensor:
    info = dtype_info(scheme.dtype)
    gran = granularity_of(scheme)
    axis = check_applicable(tuple(x.shape), gran, name=name)
    blocks, sshape = block_view(x.float(), gran, name=name)
    lo, hi = blocks.amin(dim=1, keepdim=True), blocks.amax(dim=1, keepdim=True)
    if not bool(torch.isfinite(lo).all()) or not bool(torch.isfinite(hi).all()):  # min and max carry NaN and Inf
        raise NonFiniteError(f"tensor {name!r} has NaN or Inf values", tensor=name)
    sdt = scale_torch_dtype(scheme.scale_dtype)
    iters = int(args["iters"])
    dev = blocks.device
    ratios = shrink_ratios(float(args["max_shrink"]), int(args["grid"]), dev)
    betas = (float(args["beta"]) * float(args["kappa"]) ** torch.arange(iters, dtype=torch.float64)).float().to(dev)
    consts = torch.tensor([float(info.qmax - info.qmin), float(args["lp_norm"])], device=dev)
    code_dtype = torch.int8 if info.signed else torch.uint8
    fn = _blocks_fn(iters, sdt)
    codes = torch.empty(blocks.shape, dtype=code_dtype, device=dev)
    scale, zp = torch.empty_like(lo), torch.empty_like(lo)
    step = max(1, _CHUNK_ELEMENTS // blocks.shape[1])
    for r in range(0, blocks.shape[0], step):  # chunks of block rows, each all its candidates and iterations in cache
        w = blocks[r:r + step]
        chunk = (w, lo[r:r + step], hi[r:r + step], ratios, betas, consts)
        out = None
        if kernels.KERNELS.wants(w, small=True):  # one compiled function per closure: cached by name
            out = kernels.KERNELS.call(f"hqq_blocks_{iters}_{sdt}", fn, (w.dtype,), *chunk)
        s, z = out if out is not None else fn(*chunk)
        z = (z + info.qmin).to(sdt).float()  # the code domain, as stored
        scale[r:r + step], zp[r:r + step] = s, z
        codes[r:r + step] = torch.round(w / s + z).clamp_(info.qmin, info.qmax).to(code_dtype)

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
        Arg("iters", "int", 10, "iterations; each block keeps the zero point of its least mean absolute error",
            1, 1000),
        Arg("lp_norm", "float", 0.7, "p of the ‖W − Ŵ‖_p the zero points minimise", 0.1, 1.0),
        Arg("beta", "float", 10.0, "initial weight of the quadratic coupling term", 1e-3, 1e6),
        Arg("kappa", "float", 1.01, "growth of beta per iteration", 1.0, 2.0),
        Arg("max_shrink", "float", 0.2, "the most each block's min-max range is shrunk by the start search "
                                        "(0: the min-max range, as the reference)", 0.0, 0.9),
        Arg("grid", "int", 10, "shrink ratios searched between 1 and 1 − max_shrink", 1, 200),
    )))
