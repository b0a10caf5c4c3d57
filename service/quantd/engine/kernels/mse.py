"""Compiled twin of the mse observer's candidate errors (``observers.mse``): one fused pass per candidate,
with no ``[C, B, K]`` temporary, for integer, nf4 and fp8 dtypes."""

from __future__ import annotations

import math
from typing import Any

import torch

from quantd_client._dtypes import DTypeInfo

from .quantize import FP8_TORCH_DTYPES, NF4_LEVELS, NF4_MIDPOINTS, _code_bounds

# Half the gap between the levels 2p and 2p + 1 (p = 0..7), rounded to float32 (the nf4 error kernel).
NF4_HALF_GAPS: tuple[float, ...] = tuple(float(torch.tensor((NF4_LEVELS[2 * p + 1] - NF4_LEVELS[2 * p]) / 2,
                                                            dtype=torch.float32)) for p in range(8))
# Their float32 bit patterns as int32 values, for the error kernel's bitwise selects.
NF4_MIDPOINT_BITS: tuple[int, ...] = tuple(torch.tensor(NF4_MIDPOINTS, dtype=torch.float32).view(torch.int32).tolist())
NF4_HALF_GAP_BITS: tuple[int, ...] = tuple(torch.tensor(NF4_HALF_GAPS, dtype=torch.float32).view(torch.int32).tolist())


def _code_error(t: torch.Tensor, q: torch.Tensor | float, scale: torch.Tensor, norm: float) -> torch.Tensor:
    """``sⁿ · Σ_k |t − q|ⁿ``: the error ``x − x̂ = s·(t − q)`` summed in the code domain."""
    d = t - q
    e = (d * d).sum(-1) if norm == 2.0 else d.abs().pow(norm).sum(-1)
    return e * scale.pow(norm)


def _fake_quant_error_int(x: torch.Tensor, scale: torch.Tensor, inv_scale: torch.Tensor, zero_point: torch.Tensor,
                          qmin: torch.Tensor, qmax: torch.Tensor, norm: float) -> torch.Tensor:
    t = x.unsqueeze(0) * inv_scale.unsqueeze(-1) + zero_point.unsqueeze(-1)
    return _code_error(t, torch.round(t).clamp(qmin, qmax), scale, norm)


def _fake_quant_error_nf4(x: torch.Tensor, scale: torch.Tensor, inv_scale: torch.Tensor, mids: tuple[float, ...],
                          mid_bits: tuple[int, ...], half_gap_bits: tuple[int, ...], norm: float) -> torch.Tensor:
    # The pair p of levels a < b (2p, 2p + 1) that t falls in is the number of the odd midpoints
    # mids[1], mids[3], … below it; the nearer of a and b is m ± h (m = mids[2p], h = (b − a)/2), so
    # |t − level| = ||t − m| − h| (m ± h is a or b to within an ulp). m and h come from two chains of 7
    # selects on 7 comparisons against constants, all independent of each other, where a binary search's
    # comparisons each wait on the selects of their threshold.
    # Each comparison is the sign of mids[2p − 1] − t spread over an int32 (an arithmetic shift: all ones
    # when t is above), and each select picks the bits of m and h by it (``m ^ ((m ^ v) & mask)``, one
    # ternary-logic instruction on AVX-512): a ``torch.where`` on a comparison keeps its mask as a vector
    # and converts it back to a mask register for every select, 14 more instructions per 16 values. The sign of
    # a float32 difference is that of the comparison (it is +0 when they are equal), so the pairs are those
    # of ``t > mids[2p − 1]``; NaN values give NaN errors either way.
    t = x.unsqueeze(0) * inv_scale.unsqueeze(-1)
    m: torch.Tensor | int = mid_bits[0]
    h: torch.Tensor | int = half_gap_bits[0]
    for p in range(1, len(half_gap_bits)):
        above = (mids[2 * p - 1] - t).view(torch.int32) >> 31
        m = m ^ ((m ^ mid_bits[2 * p]) & above)
        h = h ^ ((h ^ half_gap_bits[p]) & above)
    assert isinstance(m, torch.Tensor) and isinstance(h, torch.Tensor)
    return _code_error((t - m.view(torch.float32)).abs(), h.view(torch.float32), scale, norm)


def _round_fp8(v: torch.Tensor, mant: int, emin: int) -> torch.Tensor:
    """``v`` (float32, within the fp8 dtype's finite range) rounded to the nearest value of an fp8 dtype
    with ``mant`` mantissa bits and smallest normal exponent ``emin``, ties to even: the value of
    ``v.to(float8).float()``, in arithmetic that vectorises. The grid step at ``v`` is ``2^(e − mant)``
    for ``v``'s exponent ``e`` (at least ``emin``: the subnormals' step below), taken from ``v``'s bits
    with its reciprocal, both powers of two: ``round(v · 2^(mant − e)) · 2^(e − mant)`` is exact but for
    the rounding. Inductor's C++ backend converts to float8 one element at a time."""
    exponent = torch.clamp(v.view(torch.int32) & 0x7F800000, min=(emin + 127) << 23)
    step = (exponent - (mant << 23)).view(torch.float32)
    inv_step = (((254 + mant) << 23) - exponent).view(torch.float32)
    return torch.round(v * inv_step) * step


def _fake_quant_error_fp8(x: torch.Tensor, scale: torch.Tensor, inv_scale: torch.Tensor, max_finite: float,
                          mant: int, emin: int, norm: float) -> torch.Tensor:
    t = x.unsqueeze(0) * inv_scale.unsqueeze(-1)
    return _code_error(t, _round_fp8(t.clamp(-max_finite, max_finite), mant, emin), scale, norm)


def fp8_format(dtype: str) -> tuple[int, int]:
    """An fp8 dtype's mantissa bits and smallest normal exponent (e4m3: 3, −6; e5m2: 2, −14)."""
    finfo = torch.finfo(FP8_TORCH_DTYPES[dtype])
    return -math.frexp(finfo.eps)[1] + 1, math.frexp(finfo.tiny)[1] - 1


# Inductor stores a pointwise result of more than 50 ops that a reduction reads as a temporary (on CPU): the
# nf4 error's selects are more, and a [C, B, K] temporary would make that kernel memory-bound. It stays in the loop.
NO_REALIZE: dict[str, Any] = {"realize_cpu_opcount_threshold": 1000}


# Block lengths (values per block) that :func:`fix_block_length` makes a compiled kernel's constant: the usual
# group sizes. Each is a variant of its own, compiled on first use (seconds).
FIXED_BLOCK_LENGTHS = (32, 64, 128, 256)


def fix_block_length(blocks: torch.Tensor) -> int | None:
    """Have the kernels called on ``blocks[B, K]`` compiled for its block length ``K`` as a constant when it
    is one of :data:`FIXED_BLOCK_LENGTHS`, and return it (None: ``K`` stays symbolic, one variant for every
    other length). The C++ compiler then unrolls the loop over a block's values, which the nf4 error kernel's
    long body needs; the integer dtypes' mse steps gain nothing from it and keep one variant for every
    length."""
    k = int(blocks.shape[1])
    if k not in FIXED_BLOCK_LENGTHS:
        return None
    torch._dynamo.mark_static(blocks, 1)
    return k


def error_args(info: DTypeInfo, dtype: str, device: torch.device | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, str, tuple[float, int, int]]:
    """What :func:`candidate_error` takes besides the blocks and candidates for ``dtype``: an integer
    dtype's code range (:func:`_code_bounds`, on ``device``), the kind of dtype, and an fp8 dtype's largest finite value,
    mantissa bits and smallest normal exponent."""
    fp8 = (info.max_finite, *fp8_format(dtype)) if info.kind == "fp8" else (0.0, 0, 0)
    return (*_code_bounds(info.qmin, info.qmax, device), info.kind, fp8)


def candidate_error(x: torch.Tensor, scale: torch.Tensor, inv_scale: torch.Tensor, zero_point: torch.Tensor,
                    qmin: torch.Tensor, qmax: torch.Tensor, kind: str, fp8: tuple[float, int, int],
                    norm: float) -> torch.Tensor:
    """``Σ_k |x − x̂|ⁿ`` ``[C, R]`` of rows ``x[R, K]`` under candidate qparams ``scale``/``zero_point``
    ``[C, R]`` (float32; ``inv_scale = 1 / scale``; zero points only for integer dtypes) for a ``kind``
    of dtype (its other arguments from :func:`error_args`): the mse observer's inner loop, compiled in
    its search step into one fused pass per candidate with no ``[C, R, K]`` temporary, for integer, nf4
    (its pair of levels by 7 comparisons, its level as midpoint ± half gap, no gather) and fp8 dtypes.
    The same formulas as the eager ``observers.mse.fake_quant_error``, in the code domain
    (``x − x̂ = s·(t − q(t))``) and with ``t = x · (1/s)`` for ``x / s``: a multiply per element and
    candidate instead of a divide. It estimates the error of each candidate (within
    ~1e-6 relative), it does not make codes: those come from ``quantize``, which divides."""
    if kind == "nf4":
        return _fake_quant_error_nf4(x, scale, inv_scale, NF4_MIDPOINTS, NF4_MIDPOINT_BITS, NF4_HALF_GAP_BITS, norm)
    if kind == "fp8":
        return _fake_quant_error_fp8(x, scale, inv_scale, *fp8, norm)
    return _fake_quant_error_int(x, scale, inv_scale, zero_point, qmin, qmax, norm)


