"""ggml's legacy block types (32 elements, one float16 scale, optionally a float16 minimum): q8_0, q4_0,
q4_1, q5_0, q5_1, bit for bit as ``quantize_row_*_ref`` in ggml-quants.c.

Every step is the reference's float32 arithmetic in the same order (``d = max / -8``, ``id = 1 / d``,
``x · id + 8.5`` truncated), so the bytes equal ggml's (and gguf-py's NumPy port, which the tests compare
against) for any finite input. Blocks are rows of ``[N, 32]``: all blocks of a tensor in one pass.
"""

from __future__ import annotations

import torch

from ._common import argmax_abs_value, f16_bytes, f16_from, pack_bits_le, roundf, unpack_bits_le

QK = 32


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / torch.where(d == 0, torch.ones_like(d), d))


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """``[N, 32]`` codes (low 4 bits used) → ``[N, 16]`` bytes: element j in the low nibble of byte j, element
    j + 16 in the high one."""
    q = q.to(torch.uint8)
    return (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)


def _from_nibbles(qs: torch.Tensor) -> torch.Tensor:
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """``d = max|x| / 127``, ``q = roundf(x / d)`` (as ``x · (1/d)``); 34 bytes: d, 32 int8."""
    d = x.abs().amax(dim=1) / 127
    q = roundf(x * _inverse(d).unsqueeze(1)).to(torch.int8).view(torch.uint8)
    return torch.cat([f16_bytes(d), q], dim=1)


def dequantize_q8_0(b: torch.Tensor) -> torch.Tensor:
    return f16_from(b[:, :2]).unsqueeze(1) * b[:, 2:].contiguous().view(torch.int8).float()


def _sym_codes(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_0/q5_0: ``d = max / −levels/2`` (the signed value of largest magnitude), codes
    ``min(levels − 1, trunc(x·id + levels/2 + 0.5))``."""
    half = levels // 2
    d = argmax_abs_value(x) / -half
    t = torch.trunc(x * _inverse(d).unsqueeze(1) + (half + 0.5))
    return d, t.clamp(0, levels - 1).to(torch.uint8)


def _affine_codes(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q4_1/q5_1: ``d = (max − min) / (levels − 1)``, codes ``trunc((x − min)·id + 0.5)``."""
    lo = x.amin(dim=1)
    hi = x.amax(dim=1)
    d = (hi - lo) / (levels - 1)
    t = torch.trunc((x - lo.unsqueeze(1)) * _inverse(d).unsqueeze(1) + 0.5)
    return d, lo, t.clamp(0, levels - 1).to(torch.uint8)


def quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    d, q = _sym_codes(x, 16)
    return torch.cat([f16_bytes(d), _nibbles(q)], dim=1)


def dequantize_q4_0(b: torch.Tensor) -> torch.Tensor:
    return f16_from(b[:, :2]).unsqueeze(1) * (_from_nibbles(b[:, 2:]).float() - 8)


def quantize_q4_1(x: torch.Tensor) -> torch.Tensor:
    d, lo, q = _affine_codes(x, 16)
    return torch.cat([f16_bytes(d), f16_bytes(lo), _nibbles(q)], dim=1)


def dequantize_q4_1(b: torch.Tensor) -> torch.Tensor:
    return f16_from(b[:, :2]).unsqueeze(1) * _from_nibbles(b[:, 4:]).float() + f16_from(b[:, 2:4]).unsqueeze(1)


def quantize_q5_0(x: torch.Tensor) -> torch.Tensor:
    d, q = _sym_codes(x, 32)
    return torch.cat([f16_bytes(d), pack_bits_le(q >> 4), _nibbles(q)], dim=1)


def _q5_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    return _from_nibbles(qs) | (unpack_bits_le(qh) << 4)


def dequantize_q5_0(b: torch.Tensor) -> torch.Tensor:
    return f16_from(b[:, :2]).unsqueeze(1) * (_q5_codes(b[:, 2:6], b[:, 6:]).float() - 16)


def quantize_q5_1(x: torch.Tensor) -> torch.Tensor:
    d, lo, q = _affine_codes(x, 32)
    return torch.cat([f16_bytes(d), f16_bytes(lo), pack_bits_le(q >> 4), _nibbles(q)], dim=1)


def dequantize_q5_1(b: torch.Tensor) -> torch.Tensor:
    codes = _q5_codes(b[:, 4:8], b[:, 8:]).float()
    return f16_from(b[:, :2]).unsqueeze(1) * codes + f16_from(b[:, 2:4]).unsqueeze(1)
