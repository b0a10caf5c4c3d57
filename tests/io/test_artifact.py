"""The artifact: readable by safetensors, by an independent reader written from CONTRACT §5 alone,
by the NumPy SDK reader, and by the torch reader; all agree with the engine's own dequantize."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

from quantd.engine.primitives import dequantize, quantize
from quantd.engine.types import QuantizedTensor
from quantd.io.artifact import (
    ArtifactWriter,
    OutputTensor,
    dequantize_artifact,
    encode_quantized,
    quantized_layout,
    quantized_meta,
    read_artifact_torch,
)
from quantd_client import NF4_CODEBOOK, Scheme
from quantd_client._artifact import read_artifact

# --- an independent reader: CONTRACT §5 and the safetensors layout, nothing from quantd ----------

_NP = {"F32": np.float32, "F16": np.float16, "I8": np.int8, "U8": np.uint8, "I64": np.int64}
_QMIN = {"int8": -128, "int4": -8, "int3": -4, "int2": -2, "uint8": 0, "uint4": 0}
_BITS = {"int4": 4, "int3": 3, "int2": 2, "uint4": 4, "nf4": 4}


def ref_read(path: Path) -> tuple[dict[str, Any], dict[str, Any], bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    return header, json.loads(header.pop("__metadata__")["quantd"]), raw[8 + n:]


def ref_tensor(header: dict[str, Any], data: bytes, name: str) -> np.ndarray:
    e = header[name]
    b, end = e["data_offsets"]
    if e["dtype"] == "BF16":
        u = np.frombuffer(data[b:end], "<u2").astype(np.uint32) << 16
        return u.view(np.float32).reshape(e["shape"])
    if e["dtype"] in ("F8_E4M3", "F8_E5M2"):
        t = torch.frombuffer(bytearray(data[b:end]), dtype=torch.uint8)
        fdt = torch.float8_e4m3fn if e["dtype"] == "F8_E4M3" else torch.float8_e5m2
        return t.view(fdt).float().numpy().reshape(e["shape"])
    return np.frombuffer(data[b:end], _NP[e["dtype"]]).reshape(e["shape"]).copy()


def ref_unpack(stream: np.ndarray, bits: int, numel: int) -> np.ndarray:
    big = int.from_bytes(stream.tobytes(), "little")  # stream bit i = bit i of this integer
    return np.array([(big >> (j * bits)) & ((1 << bits) - 1) for j in range(numel)], dtype=np.int64)


def ref_block_index(shape: tuple[int, ...], m: dict[str, Any]) -> tuple[np.ndarray, ...]:
    """For every element (C order), the index of its scale entry."""
    if m["granularity"] == "tensor":
        return ()
    idx = np.indices(shape).reshape(len(shape), -1)
    if m["granularity"] == "group" and len(shape) <= 1:
        return (np.zeros(idx.shape[1], np.int64), idx[0] // m["group_size"])
    axis = m["axis"] % len(shape)
    row = idx[axis]
    rest = [d for d in range(len(shape)) if d != axis]
    col = np.zeros_like(row)
    for d in rest:  # position along the flattened remaining dims, C order
        col = col * shape[d] + idx[d]
    if m["granularity"] == "channel":
        return (row,)
    return (row, col // m["group_size"])


def ref_dequantize(path: Path) -> dict[str, np.ndarray]:
    header, meta, data = ref_read(path)
    out: dict[str, np.ndarray] = {}
    for name, m in meta["tensors"].items():
        shape = tuple(m["shape"])
        numel = math.prod(shape)
        q = ref_tensor(header, data, f"{name}.qdata")
        if m["dtype"] in ("float16", "bfloat16"):
            out[name] = q.astype(np.float32)
            continue
        if m["dtype"] in _BITS:
            q = ref_unpack(q, _BITS[m["dtype"]], numel)
            q = np.asarray(NF4_CODEBOOK, np.float32)[q] if m["dtype"] == "nf4" else q + _QMIN[m["dtype"]]
        flat = q.reshape(-1)
        scale = ref_tensor(header, data, f"{name}.scale").astype(np.float32)
        bi = ref_block_index(shape, m)
        s = scale[bi] if bi else np.full(numel, scale)
        if f"{name}.zero_point" in header:
            zp = ref_tensor(header, data, f"{name}.zero_point").astype(np.int64)
            z = zp[bi] if bi else np.full(numel, zp)
            flat = flat.astype(np.int64) - z
        out[name] = (flat.astype(np.float32) * s).reshape(shape)
    return out


# --- building artifacts ----------------------------------------------------------------------------

def build(path: Path, tensors: dict[str, tuple[torch.Tensor, Scheme | None]]) -> dict[str, QuantizedTensor]:
    layout: list[OutputTensor] = []
    meta: dict[str, Any] = {}
    qts: dict[str, QuantizedTensor] = {}
    writes: dict[str, torch.Tensor] = {}
    for name, (x, scheme) in tensors.items():
        if scheme is None:
            from quantd.io.formats import TORCH_TO_ST
            layout.append(OutputTensor(name, TORCH_TO_ST[x.dtype], tuple(x.shape)))
            writes[name] = x
            continue
        layout += quantized_layout(name, tuple(x.shape), scheme)
        meta[name] = quantized_meta(tuple(x.shape), x.dtype, scheme)
        qts[name] = quantize(x, scheme, name=name)
        writes |= encode_quantized(qts[name], name)
    with ArtifactWriter(path, layout, meta) as w:
        for name in reversed(list(writes)):  # any order: each tensor goes to its planned offset
            w.write(name, writes[name])
        w.finish({"note": "test"})
    return qts


CASES = [
    *[(dt, "tensor", 0) for dt in ("int8", "int4", "int3", "int2", "uint8", "uint4", "nf4", "fp8_e4m3",
                                   "fp8_e5m2", "float16", "bfloat16")],
    *[(dt, "channel", ax) for dt in ("int8", "int4", "int3", "uint4", "nf4", "fp8_e4m3") for ax in (0, 1, -1)],
    *[(dt, "group", ax) for dt in ("int8", "int4", "int3", "int2", "uint8", "nf4", "fp8_e5m2") for ax in (0, 1)],
]


def _scheme(dtype: str, gran: str, axis: int, symmetric: bool | None, scale_dtype: str) -> Scheme:
    kw: dict[str, Any] = {"dtype": dtype, "granularity": gran, "axis": axis, "group_size": 8,
                          "scale_dtype": scale_dtype}
    if symmetric is not None:
        kw["symmetric"] = symmetric
    return Scheme(**kw)


@pytest.mark.parametrize("dtype, gran, axis, symmetric",
                         [(*c, sym) for c in CASES for sym in (None, True) if not (sym and c[0].startswith("uint"))])
def test_all_readers_agree(tmp_path: Path, dtype: str, gran: str, axis: int, symmetric: bool | None) -> None:
    scale_dtype = {"int4": "bfloat16", "nf4": "float32"}.get(dtype, "float16")
    scheme = _scheme(dtype, gran, axis, symmetric, scale_dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 16, 8, generator=g) * torch.linspace(0.1, 3, 8)
    conv = torch.randn(4, 2, 3, 8, generator=g, dtype=torch.float64)
    path = tmp_path / "a.safetensors"
    ids = torch.arange(10, dtype=torch.int64)
    qts = build(path, {"w": (x, scheme), "conv": (conv, scheme), "ids": (ids, None),
                       "norm": (torch.randn(8, generator=g).bfloat16(), None)})
    engine = {n: dequantize(qt).numpy() for n, qt in qts.items()}

    # safetensors itself reads the file, metadata included
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        meta = json.loads(f.metadata()["quantd"])
        assert torch.equal(f.get_tensor("ids"), ids)
    assert meta["format_version"] == 1 and meta["summary"] == {"note": "test"}
    assert set(meta["tensors"]) == {"w", "conv"}
    assert meta["tensors"]["conv"]["orig_dtype"] == "float64"
    if dtype == "nf4":  # the table nf4 codes index, so that a reader need not know it
        assert meta["tensors"]["w"]["codebook"] == torch.tensor(NF4_CODEBOOK, dtype=torch.float32).tolist()
    else:
        assert "codebook" not in meta["tensors"]["w"]
    assert {"w.qdata", "conv.qdata", "ids", "norm"} <= keys
    assert ("w.zero_point" in keys) == (not qts["w"].symmetric and dtype not in ("float16", "bfloat16"))

    ref = ref_dequantize(path)
    sdk = read_artifact(path)
    assert sorted(sdk.quantized) == ["conv", "w"]
    sdk_all = sdk.dequantize()
    torch_all = dequantize_artifact(path, dtype=torch.float32)
    for n in ("w", "conv"):
        np.testing.assert_array_equal(ref[n], engine[n])  # the file alone reproduces the engine exactly
        np.testing.assert_array_equal(sdk_all[n], engine[n])
        np.testing.assert_array_equal(torch_all[n].numpy(), engine[n])
        assert sdk_all[n].dtype == np.float32
    np.testing.assert_array_equal(sdk_all["ids"], ids.numpy())
    np.testing.assert_array_equal(sdk_all["norm"], torch_all["norm"].float().numpy())

    back = read_artifact_torch(path)
    for n, qt in qts.items():
        if qt.codes.is_floating_point():
            assert torch.equal(back[n].codes.float(), qt.codes.float())
        else:
            assert torch.equal(back[n].codes.to(torch.int32), qt.codes.to(torch.int32))
        assert (back[n].scale is None) == (qt.scale is None)
        if qt.scale is not None and back[n].scale is not None:
            assert torch.equal(back[n].scale, qt.scale)
        assert back[n].shape == qt.shape and back[n].orig_dtype == qt.orig_dtype


def test_packed_layout_matches_contract(tmp_path: Path) -> None:
    """int4: two codes a byte, the first in the low nibble, offsets code − qmin."""
    x = torch.tensor([[-8.0, 7.0, 0.0, 1.0]])
    s = Scheme(dtype="int4", symmetric=True, granularity="tensor", scale_dtype="float32")
    path = tmp_path / "a.safetensors"
    qts = build(path, {"w": (x, s)})
    codes = qts["w"].codes.reshape(-1).tolist()
    header, _, data = ref_read(path)
    packed = ref_tensor(header, data, "w.qdata")
    assert packed.dtype == np.uint8 and packed.shape == (2,)
    assert packed[0] == ((codes[0] + 8) | ((codes[1] + 8) << 4))
    assert packed[1] == ((codes[2] + 8) | ((codes[3] + 8) << 4))


def test_header_aligned_and_padded(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    build(path, {"w": (torch.randn(4, 8), Scheme(dtype="int8", granularity="channel"))})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0
    assert raw[8:8 + n].rstrip(b" ").endswith(b"}") and raw[8 + n - 1:8 + n] == b" "
    assert not (tmp_path / "a.safetensors.tmp").exists()


def test_writer_refuses_mismatch_and_cleans_up(tmp_path: Path) -> None:
    dst = tmp_path / "out.safetensors"
    layout = [OutputTensor("a", "F32", (2, 2)), OutputTensor("b", "I64", (3,))]
    with pytest.raises(RuntimeError, match="planned"), ArtifactWriter(dst, layout, {}) as w:
        w.write("a", torch.zeros(2, 2, dtype=torch.float16))
    assert not dst.exists() and not (tmp_path / "out.safetensors.tmp").exists()
    with pytest.raises(RuntimeError, match="never written"), ArtifactWriter(dst, layout, {}) as w:
        w.write("a", torch.zeros(2, 2))
        w.finish(None)
    assert not dst.exists() and not (tmp_path / "out.safetensors.tmp").exists()


def test_sdk_reads_bytes_and_rejects_garbage(tmp_path: Path) -> None:
    from quantd_client._artifact import ArtifactError

    path = tmp_path / "a.safetensors"
    build(path, {"w": (torch.randn(4, 8), Scheme(dtype="uint4", granularity="group", group_size=4))})
    a = read_artifact(path.read_bytes())
    assert a.dequantize("w")["w"].shape == (4, 8)
    for bad in (b"", b"\x00" * 7, struct.pack("<Q", 2**40) + b"{}", struct.pack("<Q", 2) + b"{}"):
        with pytest.raises(ArtifactError):
            read_artifact(bad)


def test_fp8_and_bf16_decoding_match_torch() -> None:
    from quantd_client._artifact import E4M3_TABLE, E5M2_TABLE, bf16_to_float32

    patterns = torch.arange(256, dtype=torch.uint8)
    for table, dt in ((E4M3_TABLE, torch.float8_e4m3fn), (E5M2_TABLE, torch.float8_e5m2)):
        np.testing.assert_array_equal(table, patterns.view(dt).float().numpy())  # NaNs compare equal here
    assert np.nanmax(E4M3_TABLE) == 448.0 and not np.isinf(E4M3_TABLE).any()
    assert np.nanmax(E5M2_TABLE[np.isfinite(E5M2_TABLE)]) == 57344.0 and np.isinf(E5M2_TABLE).sum() == 2
    bits = torch.arange(0, 65536, 7, dtype=torch.int32).to(torch.int16)
    np.testing.assert_array_equal(bf16_to_float32(bits.numpy().view(np.uint16)),
                                  bits.view(torch.bfloat16).float().numpy())


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 7])
def test_sdk_unpack_matches_engine_pack(bits: int) -> None:
    from quantd.engine.packing import pack
    from quantd_client._artifact import unpack_bits

    offsets = torch.randint(0, 2**bits, (1001,), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    packed = pack(offsets, bits).numpy()
    np.testing.assert_array_equal(unpack_bits(packed, bits, 1001), offsets.numpy())
    np.testing.assert_array_equal(ref_unpack(packed, bits, 1001), offsets.numpy())


def test_sdk_reader_needs_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, quantd_client, quantd_client._artifact; "
            "bad = [m for m in ('torch', 'safetensors') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_sdk_unpack_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import quantd_client._artifact as sdk
    from quantd.engine.packing import pack

    monkeypatch.setattr(sdk, "_UNPACK_CHUNK", 64)
    offsets = torch.randint(0, 8, (1000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    np.testing.assert_array_equal(sdk.unpack_bits(pack(offsets, 3).numpy(), 3, 1000), offsets.numpy())


@pytest.mark.parametrize("dtype,symmetric", [("int4", False), ("int4", True), ("uint4", False), ("int3", True),
                                             ("int2", False), ("nf4", True)])
@pytest.mark.parametrize("numel_shape", [(16, 64), (5, 9)])  # a multiple of 8 codes (fused), and not
def test_compiled_packing_equals_eager(compiled: None, dtype: str, symmetric: bool,
                                       numel_shape: tuple[int, int]) -> None:
    from quantd.engine import kernels

    x = torch.randn(*numel_shape, generator=torch.Generator().manual_seed(3))
    qt = quantize(x, Scheme(dtype=dtype, symmetric=symmetric, granularity="channel"))
    got = encode_quantized(qt, "w")
    kernels.KERNELS.reset(available=False)
    want = encode_quantized(qt, "w")
    kernels.KERNELS.reset(available=True)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
