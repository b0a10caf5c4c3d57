"""HQQ: half-quadratic optimisation of each block's zero point, data-free (Badri & Shaji, 2023).

With the block's scale ``s`` fixed, HQQ minimises ``‖W − Q⁻¹(Q(W))‖_p`` (``p < 1``: a sparsity-promoting
norm that lets a few large errors be) over the zero point ``z`` by alternating:

- ``W_q = clamp(round(W / s + z), 0, 2ᵇ − 1)``, ``W_r = (W_q − z) · s``;
- ``W_e = shrink_p(W − W_r, β)`` (generalised soft threshold: ``sign(e) · relu(|e| − |e|^(p−1) / β)``);
- ``z = mean(W_q − (W − W_e) / s)`` over the block, ``β ← κ β``.

The reference (``hqq.core.quantize.Quantizer`` with ``optimize_weights_proximal_legacy``) starts from the
block's min-max range and runs up to 20 iterations. Here the start is close enough to the optimum that a
step or two do:

1. *range search*: the min-max range shrunk about its midpoint by each of ``grid + 1`` ratios in
   ``[1 − max_shrink, 1]``; for each, the codes it gives and the closed-form least-squares scale and offset
   for those codes (``a, b = argmin Σ (y − a·q − b)²``, as llama.cpp's ``make_qkx2_quants``); each block keeps
   the candidate of least squared error, computed from the sums ``Σq, Σq², Σqy`` without another pass;
2. ``refits`` rounds of new codes from that fit and its least-squares refit (neither raises the squared error);
3. the scale is rounded to ``scale_dtype`` and fixed; from the fitted zero point, ``iters − 1``
   half-quadratic steps, each block keeping, of the ``iters`` zero points, the one of least mean absolute
   error (no block stopped by the others).

The step is computed in code units: with ``d = W/s + z − W_q`` and ``e = s·d``,
``z − mean(d − W_e/s) = z − mean(d · min(1, |e|^(p−2)/β))``: one power per element, no sign or threshold
pass. ``β`` is in the weights' units, as in the reference: errors above ``β^(−1/(2−p))`` are the ones the
norm lets be. The default ``β = 1000`` puts that threshold at 0.005, among the rounding errors of int4
weights of typical magnitude (|w| ≲ 0.1); the reference's 10 puts it at 0.17, where the step is the plain
least-squares one.

The fit works on ``y = (W − mid)/(max − min)`` per block (the sums stay well conditioned for any offset or
magnitude). Every block of a chunk is updated at once (the loops are over candidates and steps, never
blocks). Eager, that is a few dozen elementwise passes over the chunk (each candidate and refit: codes and
three sums; each step: one power), run in the calling thread, single-threaded. With the compiled CPU kernels
on (long-lived processes, ``QUANTD_COMPILE``), the whole method on a tensor (min and max, candidates, refits,
steps, the stored zero point's rounding and the codes) is one call of one compiled kernel, a fused pass over
the blocks per stage: the same arithmetic (with fused multiply-adds), the per-call cost paid once per tensor
rather than per chunk and stage. One-shot runs stay eager and pay no compile. The zero point stays a float
(``zero_point_domain = "float"``, stored in ``scale_dtype``); codes are computed from the stored scale and zero
point, so ``x̂ = (code − zero_point) · scale`` is what was optimised.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from quantd.engine import kernels
from quantd.engine.granularity import block_view, check_applicable, granularity_of, unblock
from quantd.engine.kernels.quantize import all_finite
from quantd.engine.parallel import caller_single_threaded
from quantd.engine.qparams import round_up_to, scale_torch_dtype, smallest_positive
from quantd.engine.types import QuantizedTensor
from quantd.errors import ConfigError, NonFiniteError
from quantd_client import Scheme
from quantd_client._dtypes import dtype_info

from ._common import check_integer_scheme
from .base import Arg, LayerHessian, Method, register

# Elements per chunk: a chunk's candidates and iterations run while its few working tensors stay in cache.
_CHUNK_ELEMENTS = 1 << 18
# Compiled, the kernel fuses a chunk's passes row by row; chunks only bound its working memory.
_COMPILED_CHUNK_ELEMENTS = 1 << 22
# The zero point's rounding to its stored dtype must happen inside the kernel (the codes are computed from the
# stored value): without this, Inductor may fuse a float32 → float16 → float32 round trip away. Multiply-adds
# contract to FMAs (the candidates' codes, the sums): a few per cent faster, and they only steer the search; the
# codes from the stored scale and zero point are a division and an addition, exact either way.
_FUSED_OPTIONS = {"emulate_precision_casts": True, "cpp.enable_floating_point_contract_flag": "fast"}
# The kernel unrolls every candidate, refit and step into its graph: compile time grows with their number (the
# defaults have 8; hundreds of steps would hold the compiler for many minutes), so longer settings run eager.
_MAX_FUSED_STAGES = 24
# σ of the bit-pattern logarithm ``log₂ a ≈ bits/2²³ − 127 + σ``: the shift that halves its largest error.
_LOG2_SHIFT = 0.0430357
_INF_BITS = float(0x7F800000)  # +Inf's bits, exact in float32


def _sums(y: torch.Tensor, q: torch.Tensor, dim: int) -> torch.Tensor:
    """``[Σq, Σq², Σqy]`` of each block of ``y`` (its elements along ``dim``) and its codes ``q``: ``[3, B]``."""
    return torch.stack((q.sum(dim=dim), torch.linalg.vecdot(q, q, dim=dim), torch.linalg.vecdot(q, y, dim=dim)))


def _fit(sums: torch.Tensor, sy: torch.Tensor, vy: torch.Tensor, a0: torch.Tensor, k: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the code sums ``[…, 3, B]`` (:func:`_sums`) of rows of ``y``: the least-squares ``a, b`` of
    ``y ≈ a·q + b`` and the squared error ``Σ(y − a·q − b)²`` (``[…, B]`` each), from the centred sums. Rows
    whose codes are all equal, or whose fit is not increasing, take slope ``a0`` (with its least-squares
    offset). ``sy = Σy`` and ``vy = Σy² − (Σy)²/K`` per row."""
    sq, sqq, sqy = sums.unbind(-2)
    vq = sqq - sq * sq / k
    cqy = sqy - sq * sy / k
    a = cqy / vq
    a = torch.where((vq > 0) & (a > 0), a, a0)  # NaN (0/0) fails the test too
    return a, (sy - a * sq) / k, vy - 2.0 * a * cqy + a * a * vq


def _start(y: torch.Tensor, ratios: tuple[float, ...], refits: int, levels: float, dim: int = 1
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The range search and refits on the blocks of ``y`` (``[B, K]``, ``dim`` 1, or ``[K, B]``, ``dim`` 0;
    each block's range ``[−½, ½]`` at most): slope and offset of ``y ≈ a·(q − c0) + b`` per block, kept
    dimensions of size 1 along ``dim``, ``q ∈ [0, levels]``, ``c0 = ⌊levels/2⌋`` (codes near 0 keep the sums
    small). The candidates' fits are computed together, from their stacked sums."""
    k = y.shape[dim]
    c0 = float(int(levels) // 2)
    sy = y.sum(dim=dim)
    vy = torch.linalg.vecdot(y, y, dim=dim) - sy * sy / k
    # The constants are filled tensors (``full``), not tensors made from Python numbers (``torch.tensor``): a
    # graph that makes one cannot be kept in the compiler's cache of traced graphs, and each new process would
    # trace the compiled kernel again (seconds).
    offset = y.new_full((), levels / 2 - c0)
    sums = torch.stack([_sums(y, torch.add(offset, y, alpha=levels / r).round_().clamp_(-c0, levels - c0), dim)
                        for r in ratios])  # the candidates: [−r/2, r/2] onto [0, levels]; [C, 3, B]
    slopes = torch.stack([torch.full_like(sy, r) for r in ratios]) / levels  # each candidate's own slope
    a, b, err = _fit(sums, sy, vy, slopes, k)
    pick = err.argmin(dim=0, keepdim=True)
    a, b = a.gather(0, pick).squeeze(0), b.gather(0, pick).squeeze(0)
    for _ in range(refits):  # codes nearest to the fit, then the fit of those codes
        q = ((y - b.unsqueeze(dim)) / a.unsqueeze(dim)).round_().clamp_(-c0, levels - c0)
        a, b, _ = _fit(_sums(y, q, dim), sy, vy, a, k)
    return a.unsqueeze(dim), (b - a * c0).unsqueeze(dim)


def _power_at_most(a: torch.Tensor, c: float, top: float) -> torch.Tensor:
    """``min(top, a^c)`` for ``a ≥ 0`` and ``c`` in ``[−1.9, −1]``, to within 10 %: float32's exponent and
    mantissa bits read as an integer are ``2²³ · (log₂ a + 127 − σ)`` to within ``2²³ · 0.044``, so the power is
    a multiply-add on the bits. The bits are clamped to those of +Inf (``a = 0`` and tiny ``a`` give Inf, then
    ``top``)."""
    k = (1.0 - c) * (127.0 - _LOG2_SHIFT) * 2.0 ** 23
    bits = a.view(torch.int32).to(torch.float32).mul_(c).add_(k).clamp_(0.0, _INF_BITS)
    return bits.to(torch.int32).view(torch.float32).clamp_max_(top)


def _iterate(v: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, betas: tuple[float, ...], levels: float,
             p: float, stored: tuple[torch.dtype, float] | None = None, dim: int = 1) -> torch.Tensor:
    """The zero point of least mean absolute error, per block of ``v = W / scale`` (its elements along
    ``dim``), among the ``len(betas)`` half-quadratic iterates from ``zero`` (one ``β`` per step; the last
    iterate's error is measured, no step is taken from it). With ``stored = (dtype, qmin)`` each iterate is
    first rounded to what storing it in the code domain keeps (``(z + qmin)`` in ``dtype``), so that the zero
    point chosen is the one stored. The step's weights take the power to within 10 % (:func:`_power_at_most`,
    a multiply-add where ``pow`` costs a logarithm and an exponential): they only steer the step, and each
    iterate is judged by its exact error."""
    k = v.shape[dim]
    best, best_err = zero, torch.full_like(zero, float("inf"))
    for t, beta in enumerate(betas):
        if stored is not None:
            zero = (zero + stored[1]).to(stored[0]).float() - stored[1]
        d = v + zero
        q = torch.round(d).clamp_(0.0, levels)
        d = d.sub_(q)  # W/s + z − W_q: the error in code units
        a = d.abs()
        err = a.sum(dim=dim, keepdim=True)
        better = err < best_err
        best = torch.where(better, zero, best)
        best_err = torch.where(better, err, best_err)
        if t + 1 < len(betas):
            # d − W_e/s = d · min(1, |e|^(p−2)/β) with e = s·d; |e| = 0 gives inf, clamped: d·1 = 0
            a = a.mul_(scale)
            w = _power_at_most(a, p - 2.0, beta)
            zero = zero - torch.linalg.vecdot(d, w, dim=dim).unsqueeze(dim) / (beta * k)
    return best


def _search(w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, *, levels: float, ratios: tuple[float, ...],
            refits: int, betas: tuple[float, ...], p: float, scale_dtype: torch.dtype, qmin: float, dim: int = 1,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The search of a chunk of blocks ``w`` (``[B, K]``, ``dim`` 1, or its transpose, ``dim`` 0) with min
    ``lo`` and max ``hi`` (``[B, 1]`` or ``[1, B]``): the scale (float32 values of ``scale_dtype``), the
    offset-domain zero point (float32, before its rounding to ``scale_dtype``) and ``w / scale``."""
    flat = hi <= lo  # a constant block: its range is widened to 0, so that its value is a code's
    lo, hi = torch.where(flat, lo.clamp(max=0.0), lo), torch.where(flat, hi.clamp(min=0.0), hi)
    width = hi - lo
    width = torch.where(width > 0, width, 1.0)  # all zeros: any positive width
    mid = (lo + hi) * 0.5
    a, b = _start((w - mid).div_(width), ratios, refits, levels, dim)
    scale = round_up_to(a * width, scale_dtype).float().clamp_min(smallest_positive(scale_dtype))
    zero = -(mid + b * width) / scale
    zero = torch.where(flat, zero.round(), zero)  # exact codes for constant blocks (x̂ = their value)
    v = w / scale
    return scale, _iterate(v, scale, zero, betas, levels, p, (scale_dtype, qmin), dim), v


@functools.cache
def _fused_fn(levels: float, ratios: tuple[float, ...], refits: int, betas: tuple[float, ...], p: float,
              scale_dtype: torch.dtype, qmin: float, qmax: float, code_dtype: torch.dtype
              ) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The whole method on a chunk of blocks ``w[B, K]`` as one function of the chunk (what the compiled
    kernel fuses, its loops unrolled): min and max, :func:`_search`, the zero point rounded to what is stored
    and the codes from it. Returns ``scale, zero_point`` (``[B, 1]`` in ``scale_dtype``), ``codes`` and whether
    every value is finite (a 0-d bool: NaN and Inf show in the minima and maxima).

    It computes on the blocks' transposed view ``[K, B]``; the compiled kernel reads ``w`` where it lies (no
    copy is made, and ``.contiguous()`` keeps the codes' loop a single plain pass). Where a stage stores a
    per-element result (``w / scale``, read again by the codes), Inductor then tiles the loop 16 blocks by 16
    elements and sums each block in its own vector lane, rather than reducing a vector across its lanes for
    every block and sum: the kernel takes about 15 % less time."""

    def hqq_fused(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        w = w.t().contiguous()
        lo, hi = w.amin(dim=0, keepdim=True), w.amax(dim=0, keepdim=True)
        s, z, v = _search(w, lo, hi, levels=levels, ratios=ratios, refits=refits, betas=betas, p=p,
                          scale_dtype=scale_dtype, qmin=qmin, dim=0)
        z = (z + qmin).to(scale_dtype)  # the code domain, as stored
        codes = torch.round(v + z.float()).clamp(qmin, qmax).to(code_dtype)
        return s.to(scale_dtype).t(), z.t(), codes.t().contiguous(), all_finite(lo, hi)

    return hqq_fused


def optimize_zero_point(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, *, levels: int, iters: int,
                        lp_norm: float, beta: float, kappa: float) -> torch.Tensor:
    """The optimised float zero point (offset domain: ``W_q ∈ [0, levels]``) of each row of ``w[B, K]``,
    given float32 ``scale[B, 1]`` and the initial ``zero[B, 1]``: the best of ``iters`` iterates, per row."""
    return _iterate(w / scale, scale, zero, _betas(beta, kappa, iters), float(levels), float(lp_norm))


def _betas(beta: float, kappa: float, iters: int) -> tuple[float, ...]:
    return tuple(beta * kappa ** t for t in range(iters))


def shrink_ratios(max_shrink: float, grid: int) -> tuple[float, ...]:
    """The range ratios searched: ``grid + 1`` from 1 down to ``1 − max_shrink`` (1 alone when either is 0)."""
    if max_shrink <= 0 or grid <= 0:
        return (1.0,)
    return tuple(1.0 - max_shrink * i / grid for i in range(grid + 1))


def _compiled(blocks: torch.Tensor, fused: Callable[..., tuple[torch.Tensor, ...]], stages: int
              ) -> tuple[torch.Tensor, ...] | None:
    """The method by the compiled kernel, one call per :data:`_COMPILED_CHUNK_ELEMENTS` (a call costs more
    than a chunk's arithmetic on small tensors), or None when the kernels are off or the setting unrolls into
    more than :data:`_MAX_FUSED_STAGES` candidates, refits and steps (the caller runs eager)."""
    if stages > _MAX_FUSED_STAGES or not kernels.KERNELS.wants(blocks, small=True, cuda=False):
        return None
    step = max(1, _COMPILED_CHUNK_ELEMENTS // blocks.shape[1])
    name = f"hqq_fused_{id(fused)}"
    if blocks.shape[0] <= step:
        return kernels.KERNELS.call(name, fused, (), blocks, options=_FUSED_OPTIONS)
    parts = []
    for start in range(0, blocks.shape[0], step):
        part = kernels.KERNELS.call(name, fused, (), blocks[start:start + step], options=_FUSED_OPTIONS)
        if part is None:
            return None
        parts.append(part)
    scale, zp, codes, finite = zip(*parts, strict=True)
    return torch.cat(scale), torch.cat(zp), torch.cat(codes), torch.stack(finite).all()


def _eager(blocks: torch.Tensor, setting: tuple[Any, ...], qmax: float, code_dtype: torch.dtype
           ) -> tuple[torch.Tensor, ...]:
    """The method by eager ops, chunk by chunk (each chunk's candidates and steps while it is in cache), in the
    calling thread, single-threaded: no OpenMP join per op (spread over the chunk pool these dozens of small
    ops ran about twice as slow, the threads taking turns at the interpreter)."""
    levels, ratios, refits, betas, p, sdt, qmin = setting
    lo, hi = blocks.amin(dim=1, keepdim=True), blocks.amax(dim=1, keepdim=True)
    codes = torch.empty(blocks.shape, dtype=code_dtype, device=blocks.device)
    scale, zp = torch.empty_like(lo, dtype=sdt), torch.empty_like(lo, dtype=sdt)
    finite = all_finite(lo, hi)
    if not bool(finite):
        return scale, zp, codes, finite  # the caller raises
    step = max(1, _CHUNK_ELEMENTS // blocks.shape[1])
    with caller_single_threaded():
        for start in range(0, blocks.shape[0], step):
            rows = slice(start, start + step)
            s, z, v = _search(blocks[rows], lo[rows], hi[rows], levels=levels, ratios=ratios, refits=refits,
                              betas=betas, p=p, scale_dtype=sdt, qmin=qmin)
            z = (z + qmin).to(sdt)  # the code domain, as stored
            codes[rows] = v.add_(z.float()).round_().clamp_(qmin, qmax).to(code_dtype)
            scale[rows], zp[rows] = s, z
    return scale, zp, codes, finite


def _quantize(x: torch.Tensor, scheme: Scheme, args: Mapping[str, float | bool], calibration: LayerHessian | None,
              name: str) -> QuantizedTensor:
    info = dtype_info(scheme.dtype)
    gran = granularity_of(scheme)
    axis = check_applicable(tuple(x.shape), gran, name=name)
    blocks, sshape = block_view(x.float(), gran, name=name)
    sdt = scale_torch_dtype(scheme.scale_dtype)
    levels = float(info.qmax - info.qmin)
    ratios = shrink_ratios(float(args["max_shrink"]), int(args["grid"]))
    betas = _betas(float(args["beta"]), float(args["kappa"]), int(args["iters"]))
    code_dtype = torch.int8 if info.signed else torch.uint8
    qmin, qmax = float(info.qmin), float(info.qmax)
    setting = (levels, ratios, int(args["refits"]), betas, float(args["lp_norm"]), sdt, qmin)
    out = _compiled(blocks, _fused_fn(*setting, qmax, code_dtype), len(ratios) + setting[2] + len(betas))
    if out is None:
        out = _eager(blocks, setting, qmax, code_dtype)
    scale, zp, codes, finite = out
    if not bool(finite):
        raise NonFiniteError(f"tensor {name!r} has NaN or Inf values", tensor=name)

    return QuantizedTensor(
        codes=unblock(codes, tuple(x.shape), gran), scale=scale.reshape(sshape), zero_point=zp.reshape(sshape),
        shape=tuple(x.shape), dtype=scheme.dtype, orig_dtype=x.dtype,
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
        Arg("iters", "int", 2, "iterations; each block keeps the zero point of its least mean absolute error",
            1, 1000),
        Arg("lp_norm", "float", 0.7, "p of the ‖W − Ŵ‖_p the zero points minimise", 0.1, 1.0),
        Arg("beta", "float", 1000.0, "initial weight of the quadratic coupling term", 1e-3, 1e6),
        Arg("kappa", "float", 1.01, "growth of beta per iteration", 1.0, 2.0),
        Arg("max_shrink", "float", 0.15, "the most each block's min-max range is shrunk by the start search "
                                        "(0: the min-max range, as the reference)", 0.0, 0.9),
        Arg("grid", "int", 3, "shrink ratios searched between 1 and 1 − max_shrink", 1, 200),
        Arg("refits", "int", 2, "least-squares refits of scale and offset after the range search (0: none)",
            0, 100),
    )))
