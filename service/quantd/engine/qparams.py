"""Quantization parameters (scale, zero point) from per-block ranges.

Integer dtypes, with the range made to include 0 (``lo = min(lo, 0)``, ``hi = max(hi, 0)``):

- symmetric: ``scale = max(|lo|, |hi|) / ((qmax − qmin) / 2)``, no zero point
- affine: ``scale = (hi − lo) / (qmax − qmin)``, ``zero_point = clamp(round(qmin − lo / scale), qmin, qmax)``

nf4: ``scale = max(|lo|, |hi|)``; fp8: ``scale = max(|lo|, |hi|) / max_finite``.

The scale is computed in float64 (symmetric float16/bfloat16 scales of float32 ranges: the same value in
float32 arithmetic, :func:`_half_scale_of_absmax`) and rounded UP to ``scale_dtype`` (never below the exact value),
then clamped to ``[smallest positive, largest finite]`` of ``scale_dtype``: the observed range is
always representable (minmax never clips), and zero blocks get a tiny scale and quantize exactly
to 0. The zero point is computed from the rounded scale, so stored scale and codes agree exactly.
"""

from __future__ import annotations

import functools

import torch

from quantd_client._dtypes import DTYPES, dtype_info

SCALE_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}

_INT_VIEW: dict[torch.dtype, torch.dtype] = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
}


def scale_torch_dtype(scale_dtype: str) -> torch.dtype:
    try:
        return SCALE_TORCH_DTYPES[scale_dtype]
    except KeyError:
        raise ValueError(f"unknown scale_dtype {scale_dtype!r}; expected one of {sorted(SCALE_TORCH_DTYPES)}") \
            from None


# The smallest positive (subnormal) value of each scale dtype: bit pattern 1.
_SMALLEST_POSITIVE: dict[torch.dtype, float] = {
    torch.float16: 2.0**-24,
    torch.bfloat16: 2.0**-133,
    torch.float32: 2.0**-149,
}


def smallest_positive(dtype: torch.dtype) -> float:
    """The smallest positive value of ``dtype`` (subnormal where the dtype has them)."""
    return _SMALLEST_POSITIVE[dtype]


def round_up_to(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Non-negative ``s`` rounded to ``dtype`` towards +inf, clamped to the finite positive range.

    For positive finite floats the next representable value up is the bit pattern plus one. To float16
    and bfloat16 the value is rounded up to float32 first and then in float32 arithmetic
    (:func:`_round_up_to_half`): both are subsets of float32, so this is the same value, and it is
    code Inductor vectorises (its float64 → float16 conversion is not vectorised).
    """
    if dtype in (torch.float16, torch.bfloat16) and s.dtype in (torch.float64, torch.float32):
        v = round_up_to(s, torch.float32) if s.dtype == torch.float64 else s.clamp(min=0.0)
        return _round_up_to_half(v, dtype).to(dtype)
    r = s.to(dtype)
    below = r.to(s.dtype) < s
    r = (r.view(_INT_VIEW[dtype]) + below).view(dtype)  # + 1 on the bit pattern where rounded down (no where: slow on CPU)
    info = torch.finfo(dtype)
    return r.clamp(min=smallest_positive(dtype), max=info.max)


# Bits below float16's 10 and bfloat16's 7 mantissa bits in a float32, and float16's normal range.
_HALF_DROPPED_BITS: dict[torch.dtype, int] = {torch.float16: 13, torch.bfloat16: 16}
_FLOAT16_MIN_NORMAL = 2.0**-14


def _round_up_to_half(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The smallest float16/bfloat16 value ≥ float32 ``v ≥ 0``, clamped to the positive finite range,
    as float32. In the target's normal range (and all of bfloat16's, subnormals included) a float32 is
    representable iff its low 13 (float16) or 16 (bfloat16) mantissa bits are zero; positive floats order
    like their bit patterns, so rounding the pattern up to such a multiple rounds the value up. Below
    float16's normal range its values are the multiples of 2⁻²⁴: ``ceil(v·2²⁴)·2⁻²⁴``, exact in float32."""
    info = torch.finfo(dtype)
    v = v.clamp(max=info.max)  # finite values then cannot carry into inf or overflow int32 below
    step = 1 << _HALF_DROPPED_BITS[dtype]
    bits = (v.view(torch.int32) + (step - 1)).bitwise_and(-step)
    up = bits.view(torch.float32)
    if dtype == torch.float16:
        sub = torch.ceil(v * 2.0**24) * 2.0**-24
        up = torch.where(v < _FLOAT16_MIN_NORMAL, sub, up)
    # NaN stays NaN (the pattern arithmetic can turn one into ±0; the plain conversion kept it)
    return torch.where(v != v, v, up.clamp(min=smallest_positive(dtype)))  # v != v: isnan, vectorised (Inductor)


def scale_divisor(dtype: str, symmetric: bool) -> float:
    """What a block's range becomes a scale by dividing by: 1 (nf4), ``max_finite`` (fp8),
    ``(qmax − qmin) / 2`` (symmetric integer), ``qmax − qmin`` (affine integer); each exact in float32."""
    info = dtype_info(dtype)
    if info.kind == "int" and not symmetric:
        return float(info.qmax - info.qmin)
    return _absmax_divisor(dtype)


@functools.lru_cache(maxsize=256)
def divisor_tensor(dtype: str, symmetric: bool, device: torch.device) -> torch.Tensor:
    """:func:`scale_divisor` as a 0-d float32 tensor on ``device``, made once (read only): what the compiled
    kernels take the divisor as. CUDA divides by a constant as a multiplication by its rounded reciprocal
    (torch's eager ops for a host scalar, Inductor's CUDA kernels for a constant), which is not the quotient
    rounded once; a divisor in device memory is divided by."""
    return torch.full((), scale_divisor(dtype, symmetric), dtype=torch.float32, device=device)


def _divisor_here(dtype: str, symmetric: bool, device: torch.device) -> torch.Tensor:
    """:func:`scale_divisor` made by an eager caller. Made inside a compiled function it would be a constant of
    the graph, which Inductor's CUDA kernels multiply by the reciprocal of: compiled callers pass
    :func:`divisor_tensor` in, and tracing one that does not fails here (Dynamo's own flag: ``is_compiling()``
    is process-wide, true in every thread while any thread compiles)."""
    if torch.compiler.is_dynamo_compiling():
        raise RuntimeError("a compiled kernel must pass the scale divisor in (qparams.divisor_tensor)")
    return divisor_tensor(dtype, symmetric, device)


def choose_qparams(lo: torch.Tensor, hi: torch.Tensor, *, dtype: str, symmetric: bool, scale_dtype: str,
                   work_dtype: torch.dtype = torch.float64, divisor: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (in ``scale_dtype``) and zero point (int8 for signed, uint8 for unsigned dtypes, or
    None when symmetric / not an integer dtype) for blocks whose ranges are ``lo``, ``hi``.

    ``lo``/``hi`` may have any (equal) shape; the results have that shape. ``work_dtype`` float32 (the mse
    search's candidates) rounds the range and the quotient to nearest before rounding up to
    ``scale_dtype``: a scale may then be an ulp of ``scale_dtype`` away from float64's (two of float32).
    ``divisor``: :func:`divisor_tensor` of the scheme, which compiled callers pass in (made here otherwise).
    """
    info = dtype_info(dtype)
    sdt = scale_torch_dtype(scale_dtype)
    if divisor is None:  # a tensor, not a Python number: CUDA divides by it (see divisor_tensor)
        divisor = _divisor_here(dtype, symmetric, lo.device)
    if (work_dtype == torch.float64 and sdt in _HALF_DROPPED_BITS and lo.dtype == hi.dtype == torch.float32
            and (info.kind in ("nf4", "fp8") or (info.kind == "int" and symmetric))):
        absmax = torch.maximum(-lo.clamp(max=0.0), hi.clamp(min=0.0))
        return _half_scale_of_absmax(absmax, divisor, sdt).to(sdt), None
    lo64 = lo.to(work_dtype).clamp(max=0.0)
    hi64 = hi.to(work_dtype).clamp(min=0.0)
    scale = round_up_to(exact_scale(lo64, hi64, dtype=dtype, symmetric=symmetric, divisor=divisor), sdt)
    if info.kind == "int" and symmetric:
        scale = _clear_of_ties(torch.maximum(-lo64, hi64), scale, (info.qmax - info.qmin) / 2.0)
    if info.kind != "int" or symmetric:
        return scale, None
    zp = torch.round(info.qmin - lo64 / scale.to(work_dtype)).clamp_(info.qmin, info.qmax)
    return scale, zp.to(zero_point_dtype(dtype))


def _absmax_divisor(dtype: str) -> float:
    """What a symmetric scale divides ``absmax`` by: 1 (nf4), ``max_finite`` (fp8), ``(qmax − qmin) / 2``
    (integers); at most 8 significant bits each (255/2, 448, 57344 = 7·2¹³)."""
    info = dtype_info(dtype)
    if info.kind == "nf4":
        return 1.0
    if info.kind == "fp8":
        return float(info.max_finite)
    return (info.qmax - info.qmin) / 2.0


def _half_scale_of_absmax(absmax: torch.Tensor, divisor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``round_up_to(absmax / divisor, dtype)`` for float32 ``absmax`` and a float16/bfloat16 ``dtype``, in
    float32 arithmetic, as float32 (the float64 route's value exactly, tested against it).

    ``q = absmax / divisor`` rounded to nearest float32; the smallest ``dtype`` value ≥ ``q`` is the answer
    unless ``q`` fell below the exact quotient and is itself a ``dtype`` value: then it is the next one up.
    (When ``q`` is not a ``dtype`` value, the next ``dtype`` value above it is at least a float32 ulp above
    ``q``, so above the quotient too.) For a ``dtype`` value ``q`` (≤ 11 significant bits) ``q · divisor``
    (≤ 8 bits) is exact in float32, so ``q · divisor < absmax`` tells exactly whether ``q`` fell below.
    This avoids the float64 route, whose conversions do not vectorise on CPU."""
    q = absmax / divisor
    up = _round_up_to_half(q, dtype)
    low = (up == q) & (q * divisor < absmax)  # q is a dtype value below the quotient: one step up
    step = 1 << _HALF_DROPPED_BITS[dtype]
    nxt = (up.view(torch.int32) + step).view(torch.float32)  # the next normal value (bit pattern + one unit)
    if dtype == torch.float16:
        nxt = torch.where(up < _FLOAT16_MIN_NORMAL, up + 2.0**-24, nxt)  # subnormals: multiples of 2⁻²⁴
    return torch.where(low, nxt, up).clamp(max=torch.finfo(dtype).max)


def exact_scale(lo: torch.Tensor, hi: torch.Tensor, *, dtype: str, symmetric: bool,
                divisor: torch.Tensor | None = None) -> torch.Tensor:
    """The scale of the ranges ``lo ≤ 0 ≤ hi`` before rounding to a scale dtype, in their dtype: ``absmax``
    (nf4), ``absmax / max_finite`` (fp8), ``absmax / ((qmax − qmin) / 2)`` (symmetric integer),
    ``(hi − lo) / (qmax − qmin)`` (affine): divided by :func:`scale_divisor` (``divisor``, or a tensor of it
    made here)."""
    info = dtype_info(dtype)
    if info.kind == "float":
        raise ValueError(f"{dtype} is a plain cast and has no quantization parameters")
    if divisor is None:
        divisor = _divisor_here(dtype, symmetric, lo.device)
    absmax = torch.maximum(-lo, hi)
    if info.kind == "nf4":
        return absmax
    if info.kind == "fp8" or symmetric:
        return absmax / divisor
    return (hi - lo) / divisor


def _clear_of_ties(absmax: torch.Tensor, scale: torch.Tensor, half: float) -> torch.Tensor:
    """A float32 ``scale`` one ulp up where the encode's float32 ``−absmax / scale`` is exactly ``−half``
    (``qmin − ½``): when the exact quotient is inside, rounded half to even it gives ``qmin``, whose error
    is more than ``scale/2`` (CONTRACT §4: elements not clipped never exceed it). A scale rounded up puts
    the extreme at or inside ``±half``, within float32's relative 2⁻²³ of it: the division rounded it onto
    the tie for about a quarter of blocks. A quotient exactly on it keeps its scale: its error is exactly
    ``scale/2`` either way. float16 and bfloat16 scales are left alone: rounded up, they put the extreme
    2⁻¹¹ or 2⁻⁸ inside at random, and the division lands on the tie for ~3·10⁻⁵ of blocks, as rarely as
    for any other element, so the check would cost their kernels more than it corrects."""
    if scale.dtype != torch.float32:
        return scale
    a32 = absmax.float()
    # half · s is exact in float64: only a quotient the division rounded onto the tie, not one exactly on it
    onto_tie = (a32 / scale == half) & (a32.double() < half * scale.double())
    return torch.where(onto_tie, scale * (1.0 + 2.0**-23), scale)  # s·(1 + 2⁻²³) rounds to s + 1 or 2 ulps


def zero_point_dtype(dtype: str) -> torch.dtype:
    """int8 for signed integer dtypes, uint8 for unsigned ones."""
    return torch.int8 if DTYPES[dtype].signed else torch.uint8


def code_dtype(dtype: str) -> torch.dtype:
    """Storage of unpacked integer/nf4 codes: int8 for signed integer dtypes, uint8 otherwise."""
    info = DTYPES[dtype]
    return torch.int8 if info.kind == "int" and info.signed else torch.uint8
