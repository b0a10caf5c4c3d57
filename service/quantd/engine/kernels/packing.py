"""Compiled twin of ``packing.pack``: codes straight to the packed bitstream."""

from __future__ import annotations

import torch

from . import KERNELS


def _pack_codes(codes: torch.Tensor, qmin: int, bits: int) -> torch.Tensor:
    off = (codes - qmin).to(torch.uint8)  # codes are in [qmin, qmin + 2**bits): no wrap-around
    if 8 % bits == 0:  # whole offsets per byte, the first in the low bits (uint8 ops vectorise best)
        lanes = off.reshape(-1, 8 // bits)
        byte = lanes[:, 0]
        for j in range(1, 8 // bits):
            byte = byte | (lanes[:, j] << (j * bits))
        return byte
    # Otherwise eight offsets are 8·bits bits: exactly ``bits`` bytes of the little-endian stream.
    eights = off.reshape(-1, 8).to(torch.int64)
    word = eights[:, 0]
    for j in range(1, 8):
        word = word | (eights[:, j] << (j * bits))
    return torch.stack([(word >> (8 * k)) & 255 for k in range(bits)], dim=1).to(torch.uint8).reshape(-1)


def pack_codes(codes: torch.Tensor, qmin: int, bits: int) -> torch.Tensor | None:
    """The packed bitstream (CONTRACT §5) of the offsets ``codes − qmin``, ``codes`` flat with a multiple of
    8 elements, each in ``[qmin, qmin + 2**bits)``: one pass from the codes to the bytes, with no offsets
    tensor in between. The same bytes as ``packing.pack``."""
    return KERNELS.call("pack", _pack_codes, (codes.dtype, qmin, bits), codes.reshape(-1), qmin, bits)


