"""Hostile inputs: each raises the right typed error, quickly, without reading out of proportion."""

from __future__ import annotations

import io
import os
import pickle
import struct
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from quantd.errors import (
    InputTooLargeError,
    MalformedInputError,
    QuantdError,
    UnsafeInputError,
    UnsupportedFormatError,
)
from quantd.io import open_model


@contextmanager
def fast_error(kind: type[QuantdError], match: str | None = None, budget_s: float = 2.0) -> Iterator[None]:
    t0 = time.perf_counter()
    with pytest.raises(kind, match=match) as ei:
        yield
    assert time.perf_counter() - t0 < budget_s, "hostile input took too long to refuse"
    assert type(ei.value) is kind  # not a subclass standing in for another error


def _open_and_load_all(p: Path) -> None:
    with open_model(p) as r:
        for t in r.tensors:
            r.load(t.name, "cpu")


F32_2x2 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


def test_huge_header_length(tmp_path: Path) -> None:
    p = tmp_path / "m.safetensors"
    p.write_bytes(struct.pack("<Q", 2**62) + b'{"a": 1}' + b"\x00" * 32)
    with fast_error(MalformedInputError, "header length"):
        open_model(p)


def test_header_longer_than_file(st_file: Callable[..., Path]) -> None:
    with fast_error(MalformedInputError, "larger than the file"):
        open_model(st_file({"w": F32_2x2}, b"\x00" * 16, header_len=10_000))


def test_header_not_json(tmp_path: Path) -> None:
    p = tmp_path / "m.safetensors"
    body = b"{not json at all" + b"\xff\xfe"
    p.write_bytes(struct.pack("<Q", len(body)) + body + b"\x00" * 16)
    with fast_error(MalformedInputError, "JSON"):
        open_model(p)


def test_header_not_an_object(tmp_path: Path) -> None:
    p = tmp_path / "m.safetensors"
    body = b"{}"
    p.write_bytes(struct.pack("<Q", len(body)) + body)
    with open_model(p) as r:  # an empty safetensors file is valid: no tensors
        assert r.tensors == []


def test_a_header_of_too_many_entries_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    """Parsed, each tiny entry costs ~15 times its bytes: the header's keys, list items and nestings are
    counted on the raw bytes, whatever the entries look like (tensors, or not; keys spelled with escapes)."""
    import json
    import tracemalloc

    from quantd.io.st_header import MAX_STRUCTURE

    many = MAX_STRUCTURE + 4000
    tensors = json.dumps({f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
                          for i in range(many // 11)}, separators=(",", ":")).encode()  # 11 apiece
    p = tmp_path / "many.safetensors"
    for body in (tensors[1:-1], b",".join(b'"%d":[]' % i for i in range(many // 3)),  # 3 apiece
                 b",".join(b'"d\\u0061ta%d":[1,2]' % i for i in range(many // 4))):  # 4 apiece
        p.write_bytes(struct.pack("<Q", len(body) + 2) + b"{" + body + b"}" + bytes(4 * (many // 11)))
        tracemalloc.start()
        try:
            with fast_error(MalformedInputError, "more than 131072 tensors"):
                open_model(p)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 5 * len(body) + (8 << 20), (peak, len(body))  # a few passes over the raw bytes


def test_offsets_past_end(st_file: Callable[..., Path]) -> None:
    h = {"w": {"dtype": "F32", "shape": [1000, 1000], "data_offsets": [0, 4_000_000]}}
    with fast_error(MalformedInputError, "'w'.*outside the data section"):
        open_model(st_file(h, b"\x00" * 64))


def test_overlapping_ranges(st_file: Callable[..., Path]) -> None:
    h = {"a": F32_2x2, "b": {"dtype": "F32", "shape": [2, 2], "data_offsets": [8, 24]}}
    with fast_error(MalformedInputError, "overlaps"):
        open_model(st_file(h, b"\x00" * 24))


def test_truncated_data(tmp_path: Path) -> None:
    p = tmp_path / "m.safetensors"
    save_file({"a": torch.randn(64, 64), "b": torch.randn(64, 64)}, str(p))
    p.write_bytes(p.read_bytes()[:-100])
    with fast_error(MalformedInputError, "truncated file or lying header"):
        open_model(p)


def test_dtype_shape_mismatch(st_file: Callable[..., Path]) -> None:
    h = {"w": {"dtype": "F16", "shape": [2, 2], "data_offsets": [0, 16]}}
    with fast_error(MalformedInputError, "'w'.*needs 8"):
        open_model(st_file(h, b"\x00" * 16))


@pytest.mark.parametrize("entry, match", [
    ({"dtype": "F7", "shape": [2], "data_offsets": [0, 8]}, "unknown dtype"),
    ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, "shape"),
    ({"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}, "shape"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0]}, "data_offsets"),
    ({"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 8]}, "outside|needs"),
    ("not an object", "not an object"),
])
def test_bad_entries(st_file: Callable[..., Path], entry: object, match: str) -> None:
    with fast_error(MalformedInputError, match):
        open_model(st_file({"w": entry}, b"\x00" * 8))


class _Boom:
    """Unpickling this would create ``marker``: the readers must never run it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize("how", ["torch_zip", "legacy_pickle", "plain_pickle"])
def test_malicious_pickle_never_executed(tmp_path: Path, how: str) -> None:
    marker = tmp_path / "PWNED"
    payload = {"w": torch.ones(2), "evil": _Boom(marker)}
    p = tmp_path / "model.pt"
    if how == "torch_zip":
        torch.save(payload, p)
    elif how == "legacy_pickle":
        torch.save(payload, p, _use_new_zipfile_serialization=False)
    else:
        p.write_bytes(pickle.dumps(payload, protocol=2))
    assert not marker.exists()
    with fast_error(UnsafeInputError, "weights-only"):
        open_model(p)
    assert not marker.exists()


def test_object_npy_refused(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    p = tmp_path / "w.npy"
    np.save(p, np.array([_Boom(marker), 1], dtype=object), allow_pickle=True)
    with fast_error(UnsafeInputError, "object arrays"):
        open_model(p)
    assert not marker.exists()


def test_object_npz_refused(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    p = tmp_path / "w.npz"
    np.savez(p, good=np.ones(3), bad=np.array([_Boom(marker)], dtype=object))
    with fast_error(UnsafeInputError, "'bad'.*object arrays"):
        open_model(p)
    assert not marker.exists()


def _npy_header(shape: tuple[int, ...], dtype: str = "<f4") -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    assert buf.getvalue().startswith(b"\x93NUMPY")
    return buf.getvalue()


def test_npz_bomb_declared_shape(tmp_path: Path) -> None:
    """A member whose header claims 4 TiB: refused from the header alone."""
    p = tmp_path / "bomb.npz"
    with zipfile.ZipFile(p, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("w.npy", _npy_header((2**20, 2**20)) + b"\x00" * 1024)
    with fast_error(InputTooLargeError, "'w'.*declares 4398046511104 bytes"):
        open_model(p)


def test_npz_bomb_real_zeros_bounded(tmp_path: Path) -> None:
    """A 128 MiB member of zeros (~130 KB compressed) against a 16 MiB per-tensor limit."""
    p = tmp_path / "bomb.npz"
    n = 32 * 1024 * 1024
    with zipfile.ZipFile(p, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf, zf.open("w.npy", "w") as f:
        f.write(_npy_header((n,)))
        chunk = bytes(4 * 1024 * 1024)
        for _ in range(n * 4 // len(chunk)):
            f.write(chunk)
    assert p.stat().st_size < 2 * 1024 * 1024
    with fast_error(InputTooLargeError, "limit 16777216", budget_s=0.5):
        open_model(p, max_tensor_bytes=16 * 1024 * 1024)


def test_npz_member_size_lies(tmp_path: Path) -> None:
    """The .npy header says 100 floats, the archive holds 10: refused before inflating."""
    p = tmp_path / "lie.npz"
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("w.npy", _npy_header((100,)) + b"\x00" * 40)
    with fast_error(MalformedInputError, "declares .* uncompressed bytes"):
        open_model(p)


def test_npz_non_npy_member(tmp_path: Path) -> None:
    p = tmp_path / "x.npz"
    with zipfile.ZipFile(p, "w") as zf:
        buf = io.BytesIO()
        np.save(buf, np.ones(3, np.float32))
        zf.writestr("w.npy", buf.getvalue())
        zf.writestr("payload.pkl", b"\x80\x04N.")
    with fast_error(MalformedInputError, "'payload.pkl' is not a .npy"):
        open_model(p)


def test_npz_corrupt_member_data(tmp_path: Path) -> None:
    p = tmp_path / "x.npz"
    np.savez_compressed(p, w=np.random.default_rng(0).standard_normal(4096).astype(np.float32))
    raw = bytearray(p.read_bytes())
    mid = len(raw) // 2
    raw[mid:mid + 64] = b"\x00" * 64  # corrupt the deflate stream, keep the zip directory
    p.write_bytes(bytes(raw))
    with fast_error(MalformedInputError):
        _open_and_load_all(p)


def test_truncated_pytorch_zip(tmp_path: Path) -> None:
    p = tmp_path / "m.pt"
    torch.save({"w": torch.randn(128, 128)}, p)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    with fast_error(MalformedInputError):
        _open_and_load_all(p)


def test_corrupt_legacy_pickle(tmp_path: Path) -> None:
    # An opcode the weights-only unpickler does not take: corrupt or not, it is refused unread.
    p = tmp_path / "m.pt"
    p.write_bytes(b"\x80\x02" + b"\x00" * 30)
    with fast_error(UnsafeInputError, "weights-only"):
        open_model(p)


class _Evil:
    """Unpickled, it would run ``touch marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_protocol_4_code_pickle_is_refused_as_unsafe(tmp_path: Path) -> None:
    import pickle

    marker = tmp_path / "pwned"
    p = tmp_path / "m.pt"
    p.write_bytes(pickle.dumps({"w": _Evil(marker)}, protocol=4))
    with fast_error(UnsafeInputError, "nothing was executed"):
        open_model(p)
    assert not marker.exists()


def test_unsupported_npy_dtype(tmp_path: Path) -> None:
    p = tmp_path / "c.npy"
    np.save(p, np.ones(3, np.complex64))
    with fast_error(UnsupportedFormatError, "complex64"):
        open_model(p)


def test_duplicate_header_key(tmp_path: Path) -> None:
    body = b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, ' \
           b'"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}'
    p = tmp_path / "m.safetensors"
    p.write_bytes(struct.pack("<Q", len(body)) + body + b"\x00" * 8)
    with fast_error(MalformedInputError, "'w' appears twice"):
        open_model(p)


def test_a_refused_code_pickle_names_the_global_not_torchs_advice(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    p = tmp_path / "m.pt"
    torch.save({"w": _Evil(marker)}, p)
    with pytest.raises(UnsafeInputError) as info:
        open_model(p)
    assert "GLOBAL" in info.value.detail and "system" in info.value.detail  # what was refused
    assert "weights_only` set to `False`" not in info.value.detail  # torch's advice, cut mid-sentence
    assert not marker.exists()


def test_deeply_nested_safetensors_header(tmp_path: Path) -> None:
    """JSON nested deeper than the decoder's stack is a malformed header, not a RecursionError."""
    body = b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    p = tmp_path / "m.safetensors"
    p.write_bytes(struct.pack("<Q", len(body)) + body)
    with fast_error(MalformedInputError, "nests arrays or objects too deeply"):
        open_model(p)


@pytest.mark.parametrize("legacy", [False, True])
def test_meta_device_tensor_is_refused_naming_it(tmp_path: Path, legacy: bool) -> None:
    p = tmp_path / "m.pt"
    torch.save({"ok": torch.ones(2), "w": torch.empty(64, 64, device="meta")}, p,
               _use_new_zipfile_serialization=not legacy)
    with fast_error(MalformedInputError, "tensor 'w' is a meta-device tensor.*no data"):
        _open_and_load_all(p)


def test_expanded_pytorch_view_larger_than_the_limit_is_refused(tmp_path: Path) -> None:
    """A stride-0 view of 16 stored bytes that would materialize as 1 TiB: refused from its shape."""
    p = tmp_path / "m.pt"
    torch.save({"w": torch.zeros(4).expand(1 << 18, 1 << 18, 4)}, p)
    with fast_error(InputTooLargeError, "'w'.*1099511627776 bytes once materialized, from 16 stored"):
        open_model(p)
    torch.save({"pos": torch.arange(64).expand(1, -1)}, p)  # a broadcast buffer within its storage: kept
    with open_model(p) as r:
        assert r.tensors[0].shape == (1, 64)


@pytest.mark.parametrize("dtype", [np.longdouble, np.clongdouble, np.complex128, "V8", "M8[s]", "m8[s]", "U4",
                                   "S4", [("a", "<f4"), ("b", "<i4")]])
@pytest.mark.parametrize("container", ["npy", "npz"])
def test_unsupported_numpy_dtypes_are_refused_naming_the_dtype(tmp_path: Path, dtype: object,
                                                               container: str) -> None:
    dt = np.dtype(dtype)  # type: ignore[call-overload]
    arr = np.zeros((4, 4), dt)
    p = tmp_path / f"w.{container}"
    if container == "npy":
        np.save(p, arr)
    else:
        np.savez(p, w=arr)
    with fast_error(UnsupportedFormatError, "'w': NumPy dtype .* is not supported"):
        _open_and_load_all(p)
    with pytest.raises(UnsupportedFormatError) as info:
        open_model(p)
    assert f"NumPy dtype {dt} is not supported" in info.value.detail  # float128, complex256, <U4, ...


def test_npy_negative_dimension_is_refused_clearly(tmp_path: Path) -> None:
    p = tmp_path / "w.npy"
    p.write_bytes(_npy_header((-1, 64)) + bytes(256))
    with fast_error(MalformedInputError, r"shape \[-1, 64\] has a negative dimension"):
        open_model(p)
    p = tmp_path / "w.npz"
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("w.npy", _npy_header((2, -3)) + bytes(24))
    with fast_error(MalformedInputError, r"'w'.*negative dimension"):
        open_model(p)


def _zeros_npz(p: Path, members: dict[str, tuple[int, ...]]) -> None:
    with zipfile.ZipFile(p, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for name, shape in members.items():
            with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                f.write(_npy_header(shape))
                left = int(np.prod(shape)) * 4
                chunk = bytes(min(left, 1 << 22))
                while left:
                    f.write(chunk[:left])
                    left -= min(left, len(chunk))


def test_npz_bomb_over_the_total_limit_is_refused_before_inflating(tmp_path: Path) -> None:
    """A member of 256 MiB of zeros (~260 KB deflated) against a request's 64 MiB limit: refused from its
    header, in time and memory far below inflating it; the limit counts all members together."""
    import tracemalloc

    p = tmp_path / "bomb.npz"
    _zeros_npz(p, {"big": (8192, 8192)})
    assert p.stat().st_size < 2 * 1024 * 1024
    tracemalloc.start()
    try:
        with fast_error(InputTooLargeError, r"'big'.*declares 268435456 bytes \(the archive may unpack to "
                        r"67108864 bytes\); refused before inflating it", budget_s=0.5):
            open_model(p, max_total_bytes=64 * 1024 * 1024)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 1024 * 1024
    p2 = tmp_path / "three.npz"
    _zeros_npz(p2, {"a": (1024, 1024), "b": (1024, 1024), "c": (1024, 1024)})  # 4 MiB each
    with fast_error(InputTooLargeError, r"'c'.*10485760 bytes in all, 2097152 after the members before it"):
        open_model(p2, max_total_bytes=10 * 1024 * 1024)
    with open_model(p2, max_total_bytes=12 * 1024 * 1024) as r:  # the tensors' bytes count, not the headers
        assert [t.name for t in r.tensors] == ["a", "b", "c"]


def test_total_limit_covers_every_format(tmp_path: Path) -> None:
    p = tmp_path / "m.pt"
    w = torch.zeros(64, 64)
    torch.save({"w": w, "tied": w}, p)  # one storage, two tensors: 32 KiB once loaded
    with fast_error(InputTooLargeError, "hold 32768 bytes once loaded.*limit of 20000 bytes"):
        open_model(p, max_total_bytes=20_000)
    with open_model(p, max_total_bytes=32768) as r:
        assert len(r.tensors) == 2


class _Eval:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (eval, ("1 + 1",))


@pytest.mark.parametrize("data, why", [
    pytest.param(pickle.dumps({"w": _Eval()}, protocol=4), r"unsupported pickle opcode 0x95 \(FRAME\)",
                 id="protocol-4-eval"),
    pytest.param(b"\x80\x02\xff" + bytes(20), r"unsupported pickle opcode 0xff \(not a pickle opcode\)",
                 id="junk-opcode"),
])
def test_a_refused_pickle_always_names_a_reason(tmp_path: Path, data: bytes, why: str) -> None:
    p = tmp_path / "m.pt"
    p.write_bytes(data)
    with fast_error(UnsafeInputError, r"nothing was executed\): " + why):
        open_model(p)


@pytest.mark.parametrize("numel", [1 << 32, 5, 4097])
def test_legacy_storage_size_lie_has_a_clean_detail(tmp_path: Path, numel: int) -> None:
    p = tmp_path / "m.pt"
    torch.save({"w": torch.ones(64, 64)}, p, _use_new_zipfile_serialization=False)
    raw = bytearray(p.read_bytes())
    at = raw.rfind(struct.pack("<q", 64 * 64))  # the storage's element count, before its data
    raw[at:at + 8] = struct.pack("<q", numel)
    p.write_bytes(bytes(raw))
    with pytest.raises(MalformedInputError) as info:
        open_model(p)
    assert "%" not in info.value.detail
    assert "storage's byte size in the data section differs" in info.value.detail
