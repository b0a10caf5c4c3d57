"""Compiled twins of ``primitives`` and ``qparams``: per-block range, qparams, encode and decode.

Each public function returns None when the kernels are off (the caller then runs its eager formula).
"""

from __future__ import annotations

import functools
from typing import cast

import torch

from quantd_client._dtypes import NF4_CODEBOOK, DTypeInfo, dtype_info

from . import KERNELS

# The nf4 levels rounded to float32, and the midpoints between consecutive levels computed in float32: the
# host constants of the nf4 kernels (and of the eager encode, ``primitives``).
NF4_LEVELS: tuple[float, ...] = tuple(torch.tensor(NF4_CODEBOOK, dtype=torch.float32).tolist())
NF4_MIDPOINTS: tuple[float, ...] = tuple(((torch.tensor(NF4_LEVELS[1:]) + torch.tensor(NF4_LEVELS[:-1])) / 2).tolist())

FP8_TORCH_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _range(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = blocks.float()
    return x.amin(dim=1), x.amax(dim=1)


def _encode_int(blocks: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: torch.Tensor,
                qmax: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    q = torch.round(blocks.float() / scale) + zero_point
    return q.clamp(qmin, qmax).to(out_dtype)


def _select(bits: list[torch.Tensor], values: list[float]) -> torch.Tensor | float:
    """``values[i]`` where ``i`` is the binary number ``bits`` (most significant first), as nested wheres."""
    if not bits:
        return values[0]
    half = len(values) // 2
    return torch.where(bits[0], _select(bits[1:], values[half:]), _select(bits[1:], values[:half]))


def _nf4_bits(v: torch.Tensor, mids: tuple[float, ...]) -> list[torch.Tensor]:
    """The nf4 code of ``v`` (the number of the 15 sorted midpoints below it) as 4 bits, most significant
    first, by binary search: each comparison against the midpoint the bits before it select (11 selects
    in all). Each step halves the midpoints that ``v`` may still exceed; NaN compares false: code 0."""
    bits: list[torch.Tensor] = []
    half = (len(mids) + 1) // 2
    while half:  # this step's threshold for each prefix p of bits: mids[p·2·half + half − 1]
        bits.append(v > _select(bits, [mids[p * 2 * half + half - 1] for p in range(len(mids) // (2 * half) + 1)]))
        half //= 2
    return bits


def _encode_nf4(blocks: torch.Tensor, scale: torch.Tensor, mids: tuple[float, ...]) -> torch.Tensor:
    """The nf4 codes of ``x / scale`` from :func:`_nf4_bits`: 4 comparisons instead of 15 compare-and-add
    passes."""
    bits = _nf4_bits(blocks.float() / scale, mids)
    idx = torch.where(bits[0], 8.0, 0.0)  # summed in float32: uint8 adds do not vectorise
    for weight, bit in zip((4.0, 2.0, 1.0), bits[1:], strict=True):
        idx = idx + torch.where(bit, weight, 0.0)
    return idx.to(torch.uint8)


def _encode_fp8(blocks: torch.Tensor, scale: torch.Tensor, max_finite: float, out_dtype: torch.dtype) -> torch.Tensor:
    return (blocks.float() / scale).clamp(-max_finite, max_finite).to(out_dtype)


def row_range(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-row (min, max) of ``blocks`` in float32, one pass; None when not compiled (run eager)."""
    return KERNELS.call("range", _range, (blocks.dtype,), blocks)


@functools.lru_cache(maxsize=256)
def _code_bounds(qmin: int | None, qmax: int | None, device: torch.device | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """An integer dtype's code range as 0-d float32 tensors on ``device`` (the host when None; zeros for other
    dtypes), made once per range and device (read only). The bounds go into the kernels as tensors, not
    constants: one compiled kernel serves every bit width (Dynamo recompiles per constant value, and stops
    compiling a function after a few variants)."""
    return (torch.tensor(float(qmin or 0), dtype=torch.float32, device=device),
            torch.tensor(float(qmax or 0), dtype=torch.float32, device=device))


def encode_int(blocks: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int,
               out_dtype: torch.dtype) -> torch.Tensor | None:
    """``clamp(round(x / scale) + zero_point, qmin, qmax)`` as ``out_dtype``; scale/zero point are float32
    columns ``[B, 1]``."""
    lo, hi = _code_bounds(qmin, qmax, blocks.device)
    return KERNELS.call("int", _encode_int, (blocks.dtype, out_dtype), blocks, scale, zero_point, lo, hi, out_dtype)


def all_finite(*ts: torch.Tensor) -> torch.Tensor:
    """Whether every value of ``ts`` is finite, as a 0-d bool, from a float sum: ``t − t`` is 0 for a finite
    value and NaN for NaN or ±Inf, so the sum of those is exactly 0 or NaN (never an overflow). Inside the
    compiled kernels this stands in for a bool ``all()`` reduction fused with their other outputs, which
    Inductor can compile to return False for finite inputs."""
    total = sum(((t - t).sum() for t in ts), torch.zeros((), dtype=ts[0].dtype, device=ts[0].device))
    return total == 0


def _qparams_columns(lo: torch.Tensor, hi: torch.Tensor, dtype: str, symmetric: bool,
                     scale_dtype: str, divisor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    from quantd.engine.qparams import choose_qparams

    scale, zero_point = choose_qparams(lo, hi, dtype=dtype, symmetric=symmetric, scale_dtype=scale_dtype,
                                       divisor=divisor)
    s = scale.float().unsqueeze(1)
    z = torch.zeros_like(s) if zero_point is None else zero_point.float().unsqueeze(1)
    finite = all_finite(lo, hi)
    if zero_point is None:
        return finite, scale, s, z
    return finite, scale, s, z, zero_point


def qparams_columns(lo: torch.Tensor, hi: torch.Tensor, *, dtype: str, symmetric: bool, scale_dtype: str
                    ) -> tuple[bool, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``choose_qparams`` of the block ranges ``lo``/``hi`` ``[B]`` with what the encode kernels take:
    whether every ``lo``/``hi`` is finite, the scale (``scale_dtype``), the zero point (None when
    symmetric or not an integer dtype), and scale and zero point as float32 columns ``[B, 1]`` (zeros
    when symmetric), in one compiled kernel (eager when not compiled), where eager torch makes a dozen
    passes over ``[B]``."""
    from quantd.engine.qparams import divisor_tensor

    args = (lo, hi, dtype, symmetric, scale_dtype, divisor_tensor(dtype, symmetric, lo.device))
    out = KERNELS.call("qparams", _qparams_columns, (lo.dtype, dtype, symmetric, scale_dtype), *args)
    finite, scale, s, z, *zp = _qparams_columns(*args) if out is None else out
    return bool(finite), scale, (zp[0] if zp else None), s, z


# The dtypes whose min-max quantization runs as one compiled call (:func:`quantize_minmax`). fp8 keeps three
# calls: fused, its per-channel encode is slower.
ONE_CALL_MINMAX_KINDS = frozenset({"int", "nf4"})


def _quantize_minmax(blocks: torch.Tensor, kind: str, dtype: str, symmetric: bool, scale_dtype: str,
                     qmin: torch.Tensor, qmax: torch.Tensor, out_dtype: torch.dtype, divisor: torch.Tensor
                     ) -> tuple[torch.Tensor, ...]:
    x = blocks.float()
    if symmetric:  # only max(|lo|, |hi|) counts (always so for nf4): one reduction, not two
        absmax = x.abs().amax(dim=1)
        lo, hi = -absmax, absmax
    else:
        lo, hi = x.amin(dim=1), x.amax(dim=1)
    finite, scale, s, z, *zp = _qparams_columns(lo, hi, dtype, symmetric, scale_dtype, divisor)
    if kind == "nf4":
        codes = _encode_nf4(x, s, NF4_MIDPOINTS)
    elif symmetric and dtype_info(dtype).signed:  # (Scheme refuses symmetric unsigned dtypes)
        # |x| ≤ absmax ≤ s·(qmax + ½), so round(x / s) ≥ qmin (−qmax − ½ rounds to the even −qmax − 1) and only
        # the top needs the clamp: each clamp is three vector ops (a NaN-propagating min or max), and the
        # encode of a bfloat16 weight is compute-bound.
        codes = torch.round(x / s).clamp(max=qmax).to(out_dtype)
    else:
        codes = _encode_int(x, s, z, qmin, qmax, out_dtype)
    # Whether every range is finite and the largest scale, side by side: the caller reads both in one host sync.
    # (There is a block: the caller sends empty tensors to the eager path. Reductions over [B] alone fuse into
    # one loop; a cat would be a loop, and on CUDA a kernel, of its own.)
    top = scale.float().amax()
    flags = torch.stack([finite.to(torch.float32), top])
    # s is returned (and dropped by the caller) to make it a float32 buffer: otherwise the encode loop reads the
    # float16 scale and converts it anew for each vector it stores (its int8 stores may alias the scale, so the
    # compiler cannot hoist the load).
    return (codes, flags, scale, s, *zp)


def quantize_minmax(blocks: torch.Tensor, info: DTypeInfo, *, dtype: str, symmetric: bool, scale_dtype: str,
                    out_dtype: torch.dtype
                    ) -> tuple[torch.Tensor, bool, torch.Tensor, torch.Tensor | None, float] | None:
    """Min-max quantization of all blocks ``[B, K]`` of an integer or nf4 dtype (:data:`ONE_CALL_MINMAX_KINDS`)
    in one compiled call: the blocks' ranges (one loop over the weight; symmetric schemes reduce ``|x|``
    only, one reduction instead of two), their qparams (one over ``[B]``) and the codes (one more over the
    weight). The same loops as :func:`row_range`, :func:`qparams_columns` and :func:`encode_int` /
    :func:`encode_nf4` called one after the other, without the three calls' overheads and temporaries. Returns codes,
    whether every range is finite, scale, zero point (None when symmetric or nf4) and the largest scale (the
    last two checks read in one host sync); None when not compiled."""
    from quantd.engine.qparams import divisor_tensor

    if blocks.numel() == 0:
        return None
    lo_q, hi_q = _code_bounds(info.qmin, info.qmax, blocks.device)
    out = KERNELS.call("minmax", _quantize_minmax, (blocks.dtype, dtype, symmetric, scale_dtype, out_dtype),
                       blocks, info.kind, dtype, symmetric, scale_dtype, lo_q, hi_q, out_dtype,
                       divisor_tensor(dtype, symmetric, blocks.device))
    if out is None:
        return None
    codes, flags, scale, _, *zp = out
    finite, top = flags.tolist()
    return codes, bool(finite), scale, (zp[0] if zp else None), top


def encode_nf4(blocks: torch.Tensor, scale: torch.Tensor, mids: tuple[float, ...]) -> torch.Tensor | None:
    """nf4 codes: the number of codebook midpoints below ``x / scale``."""
    return KERNELS.call("nf4", _encode_nf4, (blocks.dtype,), blocks, scale, mids)


def encode_fp8(blocks: torch.Tensor, scale: torch.Tensor, max_finite: float,
               out_dtype: torch.dtype) -> torch.Tensor | None:
    """fp8 codes: ``x / scale`` clamped to ±max_finite and cast."""
    return KERNELS.call("fp8", _encode_fp8, (blocks.dtype, out_dtype), blocks, scale, max_finite, out_dtype)


def _decode(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    return (codes.float() - zero_point) * scale


def decode(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor | None:
    """``(codes − zero_point) · scale`` in float32 (integer and fp8 codes ``[B, K]``; scale and zero point
    float32 columns ``[B, 1]``, zeros when symmetric): the eager ``dequantize`` formula, fused."""
    return KERNELS.call("decode", _decode, (codes.dtype,), codes, scale, zero_point)


def _nf4_level(codes: torch.Tensor) -> torch.Tensor:
    """The float32 nf4 level of each code (0…15), ``NF4_LEVELS[codes]`` by a tree of selects on the code's
    4 bits, taken by comparisons in float32: vector code where a gather from the 16 levels (or bits taken
    by integer ``&``) is not."""
    f = codes.float()
    bits = []
    for weight in (8.0, 4.0, 2.0, 1.0):
        bit = f >= weight
        bits.append(bit)
        f = f - torch.where(bit, weight, 0.0)
    return cast(torch.Tensor, _select(bits, list(NF4_LEVELS)))  # four bits: a tensor, not a constant


def _decode_nf4(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _nf4_level(codes) * scale


def decode_nf4(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """``NF4_LEVELS[codes] · scale`` in float32 (nf4 indices ``[B, K]``, scale ``[B, 1]``)."""
    return KERNELS.call("decode_nf4", _decode_nf4, (), codes, scale)


