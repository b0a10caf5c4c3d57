"""Bit packing of code offsets (CONTRACT §5): one registry of pack/unpack pairs keyed by bit width.

Offsets (``code − qmin``; nf4: the codebook index) are flattened row-major into one contiguous
little-endian bitstream: offset ``j`` occupies stream bits ``[j·b, j·b + b)``, stream bit ``i`` is
bit ``i % 8`` of byte ``i // 8``. For b = 4 the first offset is the low nibble. The packed form
is a 1-D uint8 tensor of ``ceil(numel·b / 8)`` bytes; the unused high bits of the last byte are 0.

Widths dividing 8 (1, 2, 4, 8) pack whole offsets into bytes with shifts; the others (3, 5, 6, 7)
pack eight offsets into ``b`` bytes through one int64 word (unpacking goes through a bit matrix:
bytes → ``[bytes, 8]`` bits → ``[n, b]`` bits → offsets). All vectorised.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from quantd.engine.parallel import map_chunks
from quantd.errors import ConfigError, MalformedInputError

_CHUNK = 1 << 18  # offsets per chunk: a multiple of 8

PackFn = Callable[[torch.Tensor, int], torch.Tensor]
UnpackFn = Callable[[torch.Tensor, int, int], torch.Tensor]


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes of the packed bitstream of ``numel`` offsets of ``bits`` bits each."""
    return (numel * bits + 7) // 8


def _shifts(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.uint8, device=device)


def _lanes(offsets: torch.Tensor, per: int) -> torch.Tensor:
    """``offsets`` as rows of ``per`` consecutive values, zero-padded to a whole last row."""
    n = offsets.numel()
    if n % per == 0:
        return offsets.view(-1, per)
    padded = torch.zeros(-(-n // per) * per, dtype=offsets.dtype, device=offsets.device)
    padded[:n] = offsets
    return padded.view(-1, per)


def _pack_aligned(offsets: torch.Tensor, bits: int) -> torch.Tensor:
    """``bits`` divides 8: ``8 // bits`` offsets per byte, the first in the lowest bits: one shift-and-or per
    lane, elementwise over the bytes (a reduction over lanes this short does not vectorise)."""
    lanes = _lanes(offsets, 8 // bits)
    out = lanes[:, 0].clone()
    for j in range(1, lanes.shape[1]):
        out |= lanes[:, j] << (j * bits)
    return out


def _unpack_aligned(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    per = 8 // bits
    mask = (1 << bits) - 1
    lanes = (packed.unsqueeze(1) >> (_shifts(per, packed.device) * bits)) & mask
    return lanes.reshape(-1)[:numel].contiguous()


def _pack_words(offsets: torch.Tensor, bits: int) -> torch.Tensor:
    """Other widths: eight offsets are ``8·bits`` bits, exactly ``bits`` bytes of the stream, built in one int64
    word per eight offsets."""
    n = offsets.numel()
    eights = _lanes(offsets, 8).to(torch.int64)
    word = eights[:, 0].clone()
    for j in range(1, 8):
        word |= eights[:, j] << (j * bits)
    out = torch.stack([(word >> (8 * k)) & 255 for k in range(bits)], dim=1).to(torch.uint8).reshape(-1)
    return out[:packed_nbytes(n, bits)]


def _unpack_bitmatrix(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    stream = ((packed.unsqueeze(1) >> _shifts(8, packed.device)) & 1).reshape(-1)
    bit_matrix = stream[: numel * bits].view(numel, bits)
    return (bit_matrix << _shifts(bits, packed.device)).sum(dim=1, dtype=torch.uint8)


def _pack_bytes(offsets: torch.Tensor, bits: int) -> torch.Tensor:
    return offsets.reshape(-1).clone()


def _unpack_bytes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    return packed[:numel].clone()


PACKERS: dict[int, tuple[PackFn, UnpackFn]] = {
    1: (_pack_aligned, _unpack_aligned),
    2: (_pack_aligned, _unpack_aligned),
    3: (_pack_words, _unpack_bitmatrix),
    4: (_pack_aligned, _unpack_aligned),
    5: (_pack_words, _unpack_bitmatrix),
    6: (_pack_words, _unpack_bitmatrix),
    7: (_pack_words, _unpack_bitmatrix),
    8: (_pack_bytes, _unpack_bytes),
}


def _packer(bits: int) -> tuple[PackFn, UnpackFn]:
    try:
        return PACKERS[bits]
    except KeyError:
        raise ConfigError(f"no packing for {bits}-bit codes; widths 1..8 are supported", field="bits") from None


def pack(offsets: torch.Tensor, bits: int, *, name: str = "tensor") -> torch.Tensor:
    """uint8 offsets ``< 2**bits`` of any shape → 1-D uint8 bitstream of ``packed_nbytes`` bytes."""
    pack_fn, _ = _packer(bits)
    if offsets.dtype != torch.uint8:
        raise ConfigError(f"offsets must be uint8, not {offsets.dtype}", tensor=name, field="codes")
    flat = offsets.reshape(-1)
    if bits < 8 and flat.numel() and int(flat.max()) >> bits:
        raise ConfigError(f"an offset {int(flat.max())} does not fit in {bits} bits", tensor=name, field="codes")
    nbytes = packed_nbytes(flat.numel(), bits)
    if flat.numel() <= _CHUNK:
        return pack_fn(flat, bits)
    out = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
    starts = range(0, flat.numel(), _CHUNK)

    def one(i: int) -> None:  # chunks of a multiple of 8 offsets start on a byte boundary and stay in cache
        part = flat[starts[i]:starts[i] + _CHUNK]
        b0 = starts[i] * bits // 8
        out[b0:b0 + packed_nbytes(part.numel(), bits)] = pack_fn(part, bits)

    map_chunks(one, len(starts), flat.device)
    return out


def unpack(packed: torch.Tensor, bits: int, numel: int, *, name: str = "tensor") -> torch.Tensor:
    """Inverse of :func:`pack`: the first ``numel`` offsets as a 1-D uint8 tensor."""
    _, unpack_fn = _packer(bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise MalformedInputError(f"packed codes must be 1-D uint8, not {packed.dim()}-D {packed.dtype}",
                                  tensor=name, field="qdata")
    want = packed_nbytes(numel, bits)
    if numel < 0 or packed.numel() != want:
        raise MalformedInputError(f"{numel} {bits}-bit codes need {want} bytes, got {packed.numel()}",
                                  tensor=name, field="qdata")
    if numel <= _CHUNK:
        return unpack_fn(packed, bits, numel)
    out = torch.empty(numel, dtype=torch.uint8, device=packed.device)
    for start in range(0, numel, _CHUNK):
        n = min(_CHUNK, numel - start)
        b0 = start * bits // 8
        out[start:start + n] = unpack_fn(packed[b0:b0 + packed_nbytes(n, bits)], bits, n)
    return out
