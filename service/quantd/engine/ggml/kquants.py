"""ggml's k-quants (super-blocks of 256 elements): q2_k, q3_k, q4_k, q5_k, q6_k in ggml's exact byte layout.

Each super-block runs the search of ggml-quants.c's quantizer on all its sub-blocks at once
(``quantize_row_*_ref``: ``make_qkx2_quants`` for q2/q4/q5, ``make_qx_quants`` for q6; with an importance
matrix the weights and candidate grid of ``quantize_row_*_impl``, as ``llama-quantize --imatrix``), quantizes
the sub-block scales to 4/6/8 bits against float16 super-scales as ggml does, and then refits the two
super-scales by least squares on the final codes (two rounds of refit and re-round), keeping per
super-block whichever of ggml's and the refit result has the smaller (importance-weighted) squared error.
So no super-block is worse than ggml's own search, and most are better.

All super-blocks of a tensor are processed together (``x``: ``[NB, 256]`` float32); the only Python loops
run over a search's candidate scales and the two refit rounds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from quantd.engine import kernels

from ._common import (
    GROUP_MAX_EPS,
    argmax_abs_value,
    blend,
    f16_bytes,
    f16_from,
    nearest_int,
    sum_last,
    wants_kernels,
)
from ._search import affine_search, q3_search, qp_search, symmetric_search

QK_K = 256
_REFIT_ROUNDS = 2


def _f16_round(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).float()


def _safe(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v == 0, torch.ones_like(v), v)


# ---- bit layouts -------------------------------------------------------------------------------------

def _pack_2bit(q: torch.Tensor) -> torch.Tensor:
    """``[NB, 256]`` codes < 4 → ``[NB, 64]``: element 128c + 32k + l at bits 2k of byte 32c + l."""
    shifts = torch.tensor([0, 2, 4, 6], device=q.device, dtype=torch.uint8).view(1, 1, 4, 1)
    return (q.to(torch.uint8).reshape(-1, 2, 4, 32) << shifts).sum(2, dtype=torch.uint8).reshape(-1, 64)


def _unpack_2bit(b: torch.Tensor) -> torch.Tensor:
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(1, 1, 4, 1)
    return ((b.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 256)


def _pack_high(bits: torch.Tensor) -> torch.Tensor:
    """``[NB, 256]`` of 0/1 → ``[NB, 32]``: element e at bit e // 32 of byte e % 32 (q3_k's hmask, q5_k's qh)."""
    shifts = torch.arange(8, device=bits.device, dtype=torch.uint8).view(1, 8, 1)
    return (bits.to(torch.uint8).reshape(-1, 8, 32) << shifts).sum(1, dtype=torch.uint8)


def _unpack_high(b: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8).view(1, 8, 1)
    return ((b.unsqueeze(1) >> shifts) & 1).reshape(-1, 256)


def _pack_4bit(q: torch.Tensor) -> torch.Tensor:
    """``[NB, 256]`` → ``[NB, 128]``: element 64c + l in the low nibble of byte 32c + l, 64c + 32 + l high."""
    q = q.to(torch.uint8).reshape(-1, 4, 2, 32)
    return ((q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)).reshape(-1, 128)


def _unpack_4bit(b: torch.Tensor) -> torch.Tensor:
    b = b.reshape(-1, 4, 1, 32)
    return torch.cat([b & 0x0F, b >> 4], dim=2).reshape(-1, 256)


def _pack_scales_k4(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """q4_k/q5_k: eight 6-bit scales and mins into 12 bytes (the inverse of ``get_scale_min_k4``)."""
    ls = ls.to(torch.uint8)
    lm = lm.to(torch.uint8)
    lo = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    mid = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    hi = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
    return torch.cat([lo, mid, hi], dim=1)


def _unpack_scales_k4(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sc = torch.cat([b[:, :4] & 63, (b[:, 8:] & 0x0F) | ((b[:, :4] >> 6) << 4)], dim=1)
    mn = torch.cat([b[:, 4:8] & 63, (b[:, 8:] >> 4) | ((b[:, 4:8] >> 6) << 4)], dim=1)
    return sc, mn


def _pack_scales_q3(l6: torch.Tensor) -> torch.Tensor:
    """q3_k: sixteen 6-bit scales (stored + 32) into 12 bytes: low nibbles of j and j + 8 in byte j, the
    two high bits of scale j at bits 2·(j // 4) of byte 8 + j % 4."""
    l6 = l6.to(torch.uint8)
    low = (l6[:, :8] & 0x0F) | ((l6[:, 8:] & 0x0F) << 4)
    shifts = torch.tensor([0, 2, 4, 6], device=l6.device, dtype=torch.uint8).view(1, 4, 1)
    high = ((l6 >> 4).reshape(-1, 4, 4) << shifts).sum(1, dtype=torch.uint8)
    return torch.cat([low, high], dim=1)


def _unpack_scales_q3(b: torch.Tensor) -> torch.Tensor:
    low = torch.cat([b[:, :8] & 0x0F, b[:, :8] >> 4], dim=1)
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(1, 4, 1)
    high = ((b[:, 8:12].unsqueeze(1) >> shifts) & 3).reshape(-1, 16)
    return (low | (high << 4)).to(torch.int16) - 32


# ---- shared super-block machinery ---------------------------------------------------------------------

@dataclass(frozen=True)
class _Affine:
    """A super-block type with per-sub-block scale and min: ``x̂ = d·ls_j·q − dmin·lm_j``."""

    sub: int  # elements per sub-block
    nmax: int  # largest code
    levels: int  # largest stored sub-scale / sub-min
    rmin: float
    rdelta: float
    nstep: int
    use_mad: bool


_Q2 = _Affine(16, 3, 15, -0.5, 0.1, 15, True)
_Q4 = _Affine(32, 15, 63, -1.0, 0.1, 20, False)
_Q5 = _Affine(32, 31, 63, -0.5, 0.1, 15, False)


def _sigma2(x: torch.Tensor, factor: float) -> torch.Tensor:
    return factor * sum_last(x * x).unsqueeze(1) / QK_K


def _affine_weights(t: _Affine, x: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    if importance is not None:
        # quantize_row_q{2,4,5}_K_impl: qw · sqrt(σ² + x²), σ² = Σx²/256 (q2) or 2·Σx²/256
        return importance * torch.sqrt(_sigma2(x, 1.0 if t is _Q2 else 2.0) + x * x)
    if t is _Q2:
        return x.abs()
    sub = x.reshape(-1, t.sub)
    av = torch.sqrt(sum_last(sub * sub).unsqueeze(1) / t.sub)
    return (av + sub.abs()).reshape(x.shape)


def codes_error(x3: torch.Tensor, step: torch.Tensor, off: torch.Tensor | None, w3: torch.Tensor | None, lo: int,
                hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of ``x3`` ``[NB, nsub, sub]`` for each sub-block's step and offset (``[NB, nsub, 1]``; ``x̂ =
    step·q − off``: ggml's final ``nearest_int((x + off) / step)``, 0 where the step is 0) and each
    super-block's (``w3``-weighted) squared error ``[NB]``."""
    q = nearest_int((x3 if off is None else x3 + off) / _safe(step)).clamp(lo, hi)
    q = q * (step != 0).to(q.dtype)
    x_hat = step * q if off is None else step * q - off
    diff = x_hat - x3
    e = diff * diff
    return q, sum_last((e if w3 is None else e * w3).reshape(x3.shape[0], -1))


def _codes_error(x: torch.Tensor, step: torch.Tensor, off: torch.Tensor | None, weight: torch.Tensor | None,
                 lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`codes_error` of ``x`` ``[NB, 256]`` (codes as ``[NB, 256]``)."""
    nb = x.shape[0]
    x3 = x.view(nb, step.shape[1], -1)
    q, err = codes_error(x3, step, off, None if weight is None else weight.view(x3.shape), lo, hi)
    return q.reshape(nb, -1), err


def _affine_codes(t: _Affine, x: torch.Tensor, ew: torch.Tensor | None, d: torch.Tensor, dmin: torch.Tensor,
                  ls: torch.Tensor, lm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[NB, 256]`` and error ``[NB]`` for float super-scales ``d``/``dmin`` ``[NB]`` and integer
    sub-scales ``[NB, nsub]``."""
    step = (d.unsqueeze(1) * ls).unsqueeze(2)
    off = (dmin.unsqueeze(1) * lm).unsqueeze(2)
    return _codes_error(x, step, off, ew, 0, t.nmax)


def refit_sums(x3: torch.Tensor, q3: torch.Tensor, w3: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """``(Σwq, Σwq², Σwqx)`` per sub-block of ``[NB, nsub, sub]``."""
    wq = q3 if w3 is None else w3 * q3
    return sum_last(wq), sum_last(wq * q3), sum_last(wq * x3)


def _affine_refit(t: _Affine, x: torch.Tensor, weight: torch.Tensor | None, q: torch.Tensor, d: torch.Tensor,
                  dmin: torch.Tensor, ls: torch.Tensor, lm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squares ``d``, ``dmin`` for the codes ``q``: minimise Σ w (d·A − dmin·B − x)² with
    ``A = ls_j·q``, ``B = lm_j``; float16-rounded. Rows where the system is singular keep theirs."""
    nb = x.shape[0]
    x3 = x.view(nb, -1, t.sub)
    q3 = q.view(nb, -1, t.sub)
    s_w = torch.full_like(ls, float(t.sub)) if weight is None else sum_last(weight.view(nb, -1, t.sub))
    s_wx = sum_last(x3) if weight is None else sum_last(weight.view(nb, -1, t.sub) * x3)
    s_wq, s_wq2, s_wqx = refit_sums(x3, q3, None if weight is None else weight.view(nb, -1, t.sub))
    saa = sum_last(ls * ls * s_wq2)
    sab = sum_last(ls * lm * s_wq)
    sbb = sum_last(lm * lm * s_w)
    sax = sum_last(ls * s_wqx)
    sbx = sum_last(lm * s_wx)
    det = sab * sab - saa * sbb
    ok = det != 0
    det = _safe(det)
    new_d = (sab * sbx - sax * sbb) / det
    new_m = (saa * sbx - sab * sax) / det
    only_d = (sbb == 0) & (saa > 0)
    new_d = torch.where(only_d, sax / _safe(saa), new_d)
    new_m = torch.where(only_d, dmin, new_m)
    ok = ok | only_d
    return torch.where(ok, _f16_round(new_d), d), torch.where(ok, _f16_round(new_m), dmin)


def _settled(name: str, fn: Callable[..., tuple[torch.Tensor, ...]], x: torch.Tensor, ew: torch.Tensor | None,
             *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``fn(x, ew, *args)`` (a settle: codes, refits, picks) as one compiled call where the kernels run (the
    super-blocks' and sub-scales' widths static, so that the loops over a sub-block vectorise), else eager.
    The float16 roundings of the refitted super-scales stay in the kernel (``emulate_precision_casts``): the
    codes are computed from the values that are stored."""
    if wants_kernels(x):
        for v in (x, ew, *args):
            if v is not None and v.dim() == 2:
                torch._dynamo.mark_static(v, 1)
        out = kernels.KERNELS.call(name, fn, (ew is None, len(args)), x, ew, *args, options=_SETTLE_OPTIONS)
        if out is not None:
            return out
    return fn(x, ew, *args)


_SETTLE_OPTIONS = {"emulate_precision_casts": True}


@functools.cache
def _bind(fn: Callable[..., tuple[torch.Tensor, ...]], setting: object) -> Callable[..., tuple[torch.Tensor, ...]]:
    """``fn`` with its type setting bound, one function per setting (what :func:`_settled` compiles)."""
    return functools.partial(fn, setting)


def _affine_settle(t: _Affine, x: torch.Tensor, ew: torch.Tensor | None, d: torch.Tensor, dmin: torch.Tensor,
                   ls: torch.Tensor, lm: torch.Tensor, *incumbent: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`affine_settle` (compiled where the kernels run)."""
    return _settled(f"ggml_affine_settle_{t.sub}_{t.nmax}", _bind(affine_settle, t), x, ew, d, dmin, ls, lm,
                    *incumbent)


def affine_settle(t: _Affine, x: torch.Tensor, ew: torch.Tensor | None, d: torch.Tensor, dmin: torch.Tensor,
                  ls: torch.Tensor, lm: torch.Tensor, *incumbent: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Codes for one choice of super- and sub-scales, then the least-squares refit of ``d``/``dmin``, kept
    per super-block where it lowers the error. Returns ``d``, ``dmin``, codes, error ``[NB]``; or, given an
    ``incumbent`` ``(d, dmin, ls, lm, codes, error)``, per super-block the better of the two as ``d``,
    ``dmin``, ``ls``, ``lm``, codes."""
    q, best = _affine_codes(t, x, ew, d, dmin, ls, lm)
    cq, cd, cm = q, d, dmin
    for _ in range(_REFIT_ROUNDS):
        cd, cm = _affine_refit(t, x, ew, cq, cd, cm, ls, lm)
        cq, err = _affine_codes(t, x, ew, cd, cm, ls, lm)
        take = err < best
        best = torch.where(take, err, best)
        d = torch.where(take, cd, d)
        dmin = torch.where(take, cm, dmin)
        q = blend(take.unsqueeze(1), cq, q)
    if not incumbent:
        return d, dmin, q, best
    return _pick(best < incumbent[5], incumbent[:5], (d, dmin, ls, lm, q))


def _pick(take: torch.Tensor, a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Per super-block, ``b``'s tensors where ``take`` else ``a``'s (float scales by ``where``, the
    integer-valued sub-scales and codes by :func:`blend`)."""
    return tuple(torch.where(take, v, u) if u.dim() == 1 else blend(take.unsqueeze(1), v, u)
                 for u, v in zip(a, b, strict=True))


def _quantize_affine(t: _Affine, x: torch.Tensor, importance: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns float16-exact ``d``, ``dmin`` ``[NB]``, integer ``ls``, ``lm`` ``[NB, nsub]`` and codes.

    Sub-block search as ggml's ``_ref`` (or ``_impl`` with an importance matrix); the sub-scales and mins are
    quantized both as ``_ref`` does (against the largest, ``levels`` steps) and as ``_impl`` does
    (``make_qp_quants`` weighted by the sub-blocks' weights), each refitted, and the better kept."""
    nb = x.shape[0]
    w = _affine_weights(t, x, importance)
    if importance is not None:
        rmin, rdelta, nstep, use_mad = -0.9, 0.05, 36, False
    else:
        rmin, rdelta, nstep, use_mad = t.rmin, t.rdelta, t.nstep, t.use_mad
    scales, mins = affine_search(x.reshape(-1, t.sub), w.reshape(-1, t.sub), t.nmax, rmin, rdelta, nstep, use_mad)
    scales = scales.reshape(nb, -1)
    mins = mins.reshape(nb, -1)
    ew = importance
    # ggml's _ref: the largest sub-scale (sub-min) maps to ``levels``
    max_scale = scales.amax(1).clamp(min=0)
    max_min = mins.amax(1).clamp(min=0)
    inv_scale = torch.where(max_scale > 0, t.levels / _safe(max_scale), torch.zeros_like(max_scale))
    inv_min = torch.where(max_min > 0, t.levels / _safe(max_min), torch.zeros_like(max_min))
    ls = nearest_int(inv_scale.unsqueeze(1) * scales).clamp_(0, t.levels)
    lm = nearest_int(inv_min.unsqueeze(1) * mins).clamp_(0, t.levels)
    d, dmin, q, err = _affine_settle(t, x, ew, _f16_round(max_scale / t.levels), _f16_round(max_min / t.levels), ls, lm)
    # ggml's _impl: make_qp_quants over the sub-scales and sub-mins, weighted by each sub-block's Σw
    sw = sum_last(w.reshape(nb, -1, t.sub))
    # the sub-scales and the sub-mins in one search (rows are independent): half the search's ops, which on
    # these small tensors cost per op rather than per element
    dm, lsm = qp_search(torch.cat([scales, mins]).clamp(min=0), torch.cat([sw, sw]), t.levels)
    d2, m2, ls2, lm2 = dm[:nb], dm[nb:], lsm[:nb], lsm[nb:]
    d, dmin, ls, lm, q = _affine_settle(t, x, ew, _f16_round(d2), _f16_round(m2), ls2, lm2, d, dmin, ls, lm, q, err)
    return d, dmin, ls, lm, q


def _affine_decode(t: _Affine, d: torch.Tensor, dmin: torch.Tensor, ls: torch.Tensor, lm: torch.Tensor,
                   q: torch.Tensor) -> torch.Tensor:
    nb = q.shape[0]
    step = (d.unsqueeze(1) * ls.float()).unsqueeze(2)
    off = (dmin.unsqueeze(1) * lm.float()).unsqueeze(2)
    return (step * q.float().view(nb, -1, t.sub) - off).reshape(nb, -1)


def _sym_refit(x: torch.Tensor, weight: torch.Tensor | None, sub: int, d: torch.Tensor, sc: torch.Tensor,
               q: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    x3 = x.view(nb, -1, sub)
    _, s_wq2, s_wqx = refit_sums(x3, q.view(nb, -1, sub), None if weight is None else weight.view(nb, -1, sub))
    saa = sum_last(sc * sc * s_wq2)
    sax = sum_last(sc * s_wqx)
    return torch.where(saa > 0, _f16_round(sax / _safe(saa)), d)


def _sym_codes(x: torch.Tensor, ew: torch.Tensor | None, d: torch.Tensor, sc: torch.Tensor, nmax: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    return _codes_error(x, (d.unsqueeze(1) * sc).unsqueeze(2), None, ew, -nmax, nmax - 1)


def _sym_settle(x: torch.Tensor, ew: torch.Tensor | None, d: torch.Tensor, sc: torch.Tensor, nmax: int,
                *incumbent: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`sym_settle` (compiled where the kernels run)."""
    return _settled(f"ggml_sym_settle_{nmax}", _bind(sym_settle, nmax), x, ew, d, sc, *incumbent)


def sym_settle(nmax: int, x: torch.Tensor, ew: torch.Tensor | None, d: torch.Tensor, sc: torch.Tensor,
               *incumbent: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Codes for ``d`` and the sub-scales ``sc``, then the least-squares refit of ``d`` (two rounds), kept per
    super-block where it lowers the error. Returns ``d``, codes, error ``[NB]``; or, given an ``incumbent``
    ``(d, sc, codes, error)``, per super-block the better of the two as ``d``, ``sc``, codes."""
    q, best = _sym_codes(x, ew, d, sc, nmax)
    cq, cd = q, d
    for _ in range(_REFIT_ROUNDS):
        cd = _sym_refit(x, ew, 16, cd, sc, cq)
        cq, err = _sym_codes(x, ew, cd, sc, nmax)
        take = err < best
        best = torch.where(take, err, best)
        d = torch.where(take, cd, d)
        q = blend(take.unsqueeze(1), cq, q)
    if not incumbent:
        return d, q, best
    return _pick(best < incumbent[3], incumbent[:3], (d, sc, q))


def _quantize_symmetric(x: torch.Tensor, importance: torch.Tensor | None, *, nmax: int, sc_min: int, sc_max: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q3_k/q6_k: 16-element sub-blocks with signed integer sub-scales ``sc ∈ [sc_min, sc_max]`` and one
    float16 ``d``; codes ``q ∈ [−nmax, nmax − 1]``, ``x̂ = d·sc_j·q``. Returns ``d``, ``sc``, ``q``.

    Sub-block search as ggml (q3: ``make_q3_quants`` without, ``make_qx_quants`` with importance; q6:
    ``make_qx_quants``); the sub-scales quantized both against the largest (``_ref``) and by a weighted
    ``make_qx_quants`` over them (q3's ``_impl``), each refitted, and the better kept per super-block."""
    nb = x.shape[0]
    sub = x.reshape(-1, 16)
    if nmax == 4 and importance is None:
        scales = q3_search(sub, nmax)
        w = x * x
    else:
        if importance is None:
            w = x * x  # rmse_type 1
        elif nmax == 4:
            w = importance * torch.sqrt(_sigma2(x, 2.0) + x * x)  # quantize_row_q3_K_impl
        else:
            w = importance  # quantize_row_q6_K_impl passes the importance as the weights
        scales = symmetric_search(sub, w.reshape(-1, 16), nmax)
    scales = scales.reshape(nb, 16)
    ew = importance
    max_scale = argmax_abs_value(scales)
    zero = max_scale.abs() < GROUP_MAX_EPS
    iscale = torch.where(zero, torch.zeros_like(max_scale), sc_min / torch.where(zero, torch.ones_like(max_scale),
                                                                                    max_scale))
    d = torch.where(zero, torch.zeros_like(iscale), _f16_round(1 / torch.where(zero, torch.ones_like(iscale), iscale)))
    sc = nearest_int(iscale.unsqueeze(1) * scales).clamp_(sc_min, sc_max)
    d, q, err = _sym_settle(x, ew, d, sc, nmax)
    sw = sum_last(w.reshape(nb, 16, 16))
    d2 = _f16_round(symmetric_search(scales, sw, -sc_min))
    sc2 = nearest_int(scales / _safe(d2).unsqueeze(1)).clamp_(sc_min, sc_max)
    sc2 = torch.where((d2 == 0).unsqueeze(1), torch.zeros_like(sc2), sc2)
    d, sc, q = _sym_settle(x, ew, d2, sc2, nmax, d, sc, q, err)
    return d, sc, q


# ---- the five types ------------------------------------------------------------------------------------

def quantize_q2_k(x: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """84 bytes: 16 × (4-bit scale | 4-bit min), 64 bytes of 2-bit codes, d, dmin."""
    d, dmin, ls, lm, q = _quantize_affine(_Q2, x, importance)
    scales = ls.to(torch.uint8) | (lm.to(torch.uint8) << 4)
    return torch.cat([scales, _pack_2bit(q), f16_bytes(d), f16_bytes(dmin)], dim=1)


def dequantize_q2_k(b: torch.Tensor) -> torch.Tensor:
    scales = b[:, :16]
    q = _unpack_2bit(b[:, 16:80])
    return _affine_decode(_Q2, f16_from(b[:, 80:82]), f16_from(b[:, 82:84]), scales & 0x0F, scales >> 4, q)


def quantize_q3_k(x: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """110 bytes: hmask (the codes' third bit), 64 bytes of low 2 bits, 12 bytes of 6-bit scales, d."""
    d, sc, q = _quantize_symmetric(x, importance, nmax=4, sc_min=-32, sc_max=31)
    u = (q + 4).to(torch.uint8)
    return torch.cat([_pack_high(u >> 2), _pack_2bit(u & 3), _pack_scales_q3(sc + 32), f16_bytes(d)], dim=1)


def dequantize_q3_k(b: torch.Tensor) -> torch.Tensor:
    q = (_unpack_2bit(b[:, 32:96]) | (_unpack_high(b[:, :32]) << 2)).float() - 4
    sc = _unpack_scales_q3(b[:, 96:108]).float()
    return ((f16_from(b[:, 108:110]).unsqueeze(1) * sc).unsqueeze(2) * q.view(-1, 16, 16)).reshape(-1, 256)


def quantize_q4_k(x: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """144 bytes: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit codes."""
    d, dmin, ls, lm, q = _quantize_affine(_Q4, x, importance)
    return torch.cat([f16_bytes(d), f16_bytes(dmin), _pack_scales_k4(ls, lm), _pack_4bit(q)], dim=1)


def dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    ls, lm = _unpack_scales_k4(b[:, 4:16])
    return _affine_decode(_Q4, f16_from(b[:, :2]), f16_from(b[:, 2:4]), ls, lm, _unpack_4bit(b[:, 16:]))


def quantize_q5_k(x: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """176 bytes: d, dmin, 12 bytes of scales and mins, 32 bytes of fifth bits, 128 bytes of low nibbles."""
    d, dmin, ls, lm, q = _quantize_affine(_Q5, x, importance)
    u = q.to(torch.uint8)
    return torch.cat([f16_bytes(d), f16_bytes(dmin), _pack_scales_k4(ls, lm), _pack_high(u >> 4),
                      _pack_4bit(u & 0x0F)], dim=1)


def dequantize_q5_k(b: torch.Tensor) -> torch.Tensor:
    ls, lm = _unpack_scales_k4(b[:, 4:16])
    q = _unpack_4bit(b[:, 48:]) | (_unpack_high(b[:, 16:48]) << 4)
    return _affine_decode(_Q5, f16_from(b[:, :2]), f16_from(b[:, 2:4]), ls, lm, q)


def quantize_q6_k(x: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """210 bytes: 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales, d."""
    d, sc, q = _quantize_symmetric(x, importance, nmax=32, sc_min=-128, sc_max=127)
    u = (q + 32).to(torch.uint8).reshape(-1, 2, 4, 32)
    ql = ((u[:, :, 0:2] & 0x0F) | ((u[:, :, 2:4] & 0x0F) << 4)).reshape(-1, 128)
    shifts = torch.tensor([0, 2, 4, 6], device=x.device, dtype=torch.uint8).view(1, 1, 4, 1)
    qh = ((u >> 4) << shifts).sum(2, dtype=torch.uint8).reshape(-1, 64)
    return torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), f16_bytes(d)], dim=1)


def dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[:, :128].reshape(-1, 2, 1, 64)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 2, 4, 32)
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(1, 1, 4, 1)
    high = (b[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 3
    q = (low | (high << 4)).reshape(-1, 256).float() - 32
    sc = b[:, 192:208].contiguous().view(torch.int8).float()
    return ((f16_from(b[:, 208:210]).unsqueeze(1) * sc).unsqueeze(2) * q.view(-1, 16, 16)).reshape(-1, 256)
