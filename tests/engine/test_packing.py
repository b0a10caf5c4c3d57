"""Bit packing: exact layout of CONTRACT §5 against a bit-by-bit reference, round trips, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantd.engine import packing
from quantd.engine.packing import PACKERS, pack, packed_nbytes, unpack
from quantd.errors import ConfigError, MalformedInputError


def ref_pack(offsets: list[int], bits: int) -> list[int]:
    """Offset j at stream bits [j·b, j·b + b); stream bit i is bit i % 8 of byte i // 8."""
    out = [0] * ((len(offsets) * bits + 7) // 8)
    for j, v in enumerate(offsets):
        for k in range(bits):
            i = j * bits + k
            out[i // 8] |= ((v >> k) & 1) << (i % 8)
    return out


def test_registry_covers_every_width() -> None:
    assert sorted(PACKERS) == list(range(1, 9))


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 1001])
def test_pack_matches_bit_reference_and_round_trips(bits: int, n: int) -> None:
    g = torch.Generator().manual_seed(bits * 1000 + n)
    offsets = torch.randint(0, 2**bits, (n,), generator=g, dtype=torch.uint8)
    packed = pack(offsets, bits)
    assert packed.dtype == torch.uint8 and packed.dim() == 1 and packed.numel() == packed_nbytes(n, bits)
    assert packed.tolist() == ref_pack(offsets.tolist(), bits)
    assert torch.equal(unpack(packed, bits, n), offsets)


def test_known_layouts() -> None:
    o = torch.tensor([1, 2, 3], dtype=torch.uint8)
    assert pack(o, 4).tolist() == [0x21, 0x03]  # int4: first code in the low nibble
    assert pack(o, 2).tolist() == [0b111001]  # 1 | 2 << 2 | 3 << 4
    assert pack(o, 3).tolist() == [0b11010001, 0]  # 001 010 011 → bits 1,0,0 | 0,1,0 | 1,1,0


@pytest.mark.parametrize("bits", [3, 4, 5])
def test_chunked_packing_equals_reference(monkeypatch: pytest.MonkeyPatch, bits: int) -> None:
    monkeypatch.setattr(packing, "_CHUNK", 16)  # many chunks, each a multiple of 8 offsets
    offsets = torch.randint(0, 2**bits, (3, 45), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    packed = pack(offsets, bits)
    assert packed.tolist() == ref_pack(offsets.reshape(-1).tolist(), bits)
    assert torch.equal(unpack(packed, bits, offsets.numel()), offsets.reshape(-1))


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), data=st.data())
def test_pack_unpack_identity(bits: int, data: st.DataObject) -> None:
    values = data.draw(st.lists(st.integers(0, 2**bits - 1), max_size=200))
    offsets = torch.tensor(values, dtype=torch.uint8)
    assert unpack(pack(offsets, bits), bits, len(values)).tolist() == values


@pytest.mark.parametrize("bits", [0, 9, 16])
def test_unsupported_width(bits: int) -> None:
    with pytest.raises(ConfigError, match="bits"):
        pack(torch.zeros(4, dtype=torch.uint8), bits)


def test_offset_too_wide_names_tensor() -> None:
    with pytest.raises(ConfigError, match="does not fit") as e:
        pack(torch.tensor([0, 8], dtype=torch.uint8), 3, name="w")
    assert e.value.tensor == "w"


def test_wrong_offset_dtype() -> None:
    with pytest.raises(ConfigError, match="uint8"):
        pack(torch.tensor([0, 1], dtype=torch.int8), 4)


@pytest.mark.parametrize("nbytes", [2, 4])
def test_unpack_wrong_length_is_malformed(nbytes: int) -> None:
    with pytest.raises(MalformedInputError, match="need 3 bytes") as e:
        unpack(torch.zeros(nbytes, dtype=torch.uint8), 3, 8, name="w.qdata")
    assert e.value.tensor == "w.qdata"
