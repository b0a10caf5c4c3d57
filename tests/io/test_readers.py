"""Every input format round-trips tensor by tensor, detected by content, not by extension."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from quantd.errors import MalformedInputError, UnsupportedFormatError
from quantd.io import detect_format, open_model
from quantd.io.readers import sanitize_name


def _ref_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w32": torch.randn(4, 6, generator=g),
        "w16": torch.randn(3, 5, generator=g).half(),
        "wbf": torch.randn(2, 8, generator=g).bfloat16(),
        "w64": torch.randn(5, 2, generator=g, dtype=torch.float64),
        "ids": torch.arange(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }


def _check_all(path: Path, expected: dict[str, torch.Tensor], fmt: str, filename: str | None = None) -> None:
    with open_model(path, filename) as r:
        assert r.format == fmt
        assert {t.name for t in r.tensors} == set(expected)
        for info in r.tensors:
            ref = expected[info.name]
            assert info.shape == tuple(ref.shape)
            assert info.dtype == str(ref.dtype).removeprefix("torch.")
            assert info.nbytes == ref.numel() * ref.element_size()
            got = r.load(info.name, "cpu")
            assert got.dtype == ref.dtype and got.shape == ref.shape
            assert torch.equal(got, ref)


def test_safetensors_round_trip_any_extension(tmp_path: Path) -> None:
    ref = _ref_tensors()
    p = tmp_path / "weights.bin"  # the extension lies; the content decides
    save_file(ref, str(p))
    assert detect_format(p) == "safetensors"
    _check_all(p, ref, "safetensors")


@pytest.mark.parametrize("header_bytes", [632, 640, 896, 1152, 1408, 640 + 65536])
def test_safetensors_whose_header_length_starts_like_a_pickle(tmp_path: Path, header_bytes: int) -> None:
    """A header of 640 bytes (0x280) starts the file with ``80 02``, a pickle's protocol-2 magic: the file is
    still safetensors, as the reference reader reads it."""
    import json
    import struct

    from safetensors.torch import load_file

    w = torch.randn(8, 16)
    header = json.dumps({"w.weight": {"dtype": "F32", "shape": [8, 16], "data_offsets": [0, w.numel() * 4]}})
    p = tmp_path / "model.safetensors"
    padded = header.encode().ljust(header_bytes - 1) + (b"\n" if header_bytes % 512 == 384 else b" ")  # 896, 1408
    p.write_bytes(struct.pack("<Q", header_bytes) + padded + w.numpy().tobytes())
    assert torch.equal(load_file(str(p))["w.weight"], w)
    assert detect_format(p) == "safetensors"
    _check_all(p, {"w.weight": w}, "safetensors")


def test_a_pickle_is_not_taken_for_safetensors_by_its_ninth_byte(tmp_path: Path) -> None:
    """A protocol-2 pickle whose ninth byte happens to be ``{`` stays a PyTorch file (refused here as one)."""
    p = tmp_path / "x.bin"
    p.write_bytes(b"\x80\x02" + b"}q\x00(X\x01" + b"{" + b"\x00" * 40)
    assert detect_format(p) == "pytorch"


def test_pytorch_zip_nested_state_dict(tmp_path: Path) -> None:
    ref = _ref_tensors()
    p = tmp_path / "ckpt.npy"
    torch.save({"model": {"enc": {k: v for k, v in ref.items() if k != "scalar"}, "scalar": ref["scalar"]},
                }, p)
    assert detect_format(p) == "pytorch"
    expected = {f"enc.{k}": v for k, v in ref.items() if k != "scalar"} | {"scalar": ref["scalar"]}
    _check_all(p, expected, "pytorch")


def test_pytorch_non_tensor_leaves_skipped_and_top_level_kept(tmp_path: Path) -> None:
    p = tmp_path / "ckpt.pt"
    w = torch.randn(2, 3)
    torch.save({"epoch": 3, "state_dict": {"w": w}, "names": ["a", "b"], "lr": 0.1}, p)
    _check_all(p, {"state_dict.w": w}, "pytorch")


def test_pytorch_tensors_in_lists_are_named_by_index(tmp_path: Path) -> None:
    # tensors inside lists and tuples are model weights too: each gets a name from its index
    a, b, c, d = (torch.randn(4, 8) for _ in range(4))
    p = tmp_path / "ckpt.pt"
    torch.save({"enc": {"w": a}, "layers": [b, {"w": c}], "pair": (d, 3)}, p)
    _check_all(p, {"enc.w": a, "layers.0": b, "layers.1.w": c, "pair.0": d}, "pytorch")
    top = tmp_path / "list.pt"
    torch.save([a, b], top)
    _check_all(top, {"0": a, "1": b}, "pytorch")
    clash = tmp_path / "clash.pt"
    torch.save({"layers.0": a, "layers": [b]}, clash)
    with pytest.raises(MalformedInputError, match="appears twice"):
        open_model(clash)


def test_pytorch_self_referencing_or_deep_containers_are_refused(tmp_path: Path) -> None:
    # the weights-only unpickler builds them; flattening recursed until RecursionError (a 500)
    loop: list[object] = [torch.ones(2)]
    loop.append(loop)
    selfish: dict[str, object] = {"w": torch.ones(2)}
    selfish["me"] = selfish
    deep: object = torch.ones(2)
    for _ in range(200):
        deep = [deep]
    for name, obj, why in (("loop", {"x": loop}, "contains itself"), ("selfish", selfish, "contains itself"),
                           ("deep", {"x": deep}, "more than 64 deep")):
        p = tmp_path / f"{name}.pt"
        torch.save(obj, p)
        with pytest.raises(MalformedInputError, match=why):
            open_model(p)
    shared = tmp_path / "shared.pt"  # the same container twice, side by side, is no cycle
    inner = [torch.ones(2)]
    torch.save({"a": inner, "b": inner}, shared)
    with open_model(shared) as r:
        assert [t.name for t in r.tensors] == ["a.0", "b.0"]


def test_pytorch_legacy_pickle(tmp_path: Path) -> None:
    ref = {k: v for k, v in _ref_tensors().items() if k != "empty"}
    p = tmp_path / "legacy.pth"
    torch.save(ref, p, _use_new_zipfile_serialization=False)
    assert p.read_bytes()[:2] == b"\x80\x02"
    _check_all(p, ref, "pytorch")


def test_pytorch_bare_tensor_named_by_stem(tmp_path: Path) -> None:
    p = tmp_path / "x.pt"
    w = torch.randn(3, 3)
    torch.save(w, p)
    _check_all(p, {"emb": w}, "pytorch", filename="emb.pt")


@pytest.mark.parametrize("dtype", ["<f4", ">f4", "<f2", "<f8", "<i8", "|u1", "|b1"])
@pytest.mark.parametrize("fortran", [False, True])
def test_npy_round_trip(tmp_path: Path, dtype: str, fortran: bool) -> None:
    a = (np.arange(24).reshape(4, 6) % 5).astype(dtype)
    if fortran:
        a = np.asfortranarray(a)
    p = tmp_path / "upload.tmp"
    np.save(p, a)
    p = tmp_path / "upload.tmp.npy"
    assert detect_format(p) == "npy"
    with open_model(p, "My Layer (1).weight.npy") as r:
        (info,) = r.tensors
        assert info.name == "My_Layer__1_.weight"
        got = r.load(info.name, "cpu")
    assert got.is_contiguous()
    np.testing.assert_array_equal(got.numpy(), a)
    assert got.numpy().dtype == a.dtype.newbyteorder("=")


def test_npz_round_trip(tmp_path: Path) -> None:
    arrays = {"a": np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32),
              "b": np.arange(5, dtype=np.int32), "c": np.zeros((0, 3), np.float16)}
    for compress in (np.savez, np.savez_compressed):
        p = tmp_path / f"{compress.__name__}.weights"
        with p.open("wb") as f:  # a file object: numpy would otherwise append ".npz"
            compress(f, **arrays)
        assert detect_format(p) == "npz"
        _check_all(p, {k: torch.from_numpy(v) for k, v in arrays.items()}, "npz")


def test_sanitize_name() -> None:
    assert sanitize_name("../../etc/passwd") == "_.._etc_passwd"
    assert sanitize_name("") == "tensor"
    assert sanitize_name("layer.0-w") == "layer.0-w"


def test_an_empty_file_says_so(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors"
    p.write_bytes(b"")
    with pytest.raises(MalformedInputError, match=r"the file is empty \(0 bytes\)"):
        open_model(p)


@pytest.mark.parametrize("content", [b"hello world, not a model", b"\x00" * 64,
                                     b"\x89PNG\r\n\x1a\n" + b"\x00" * 32])
def test_junk_is_unsupported(tmp_path: Path, content: bytes) -> None:
    p = tmp_path / "model.safetensors"
    p.write_bytes(content)
    with pytest.raises(UnsupportedFormatError):
        open_model(p)


def test_zip_of_other_files_is_unsupported(tmp_path: Path) -> None:
    p = tmp_path / "x.npz"
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("readme.txt", "hi")
    with pytest.raises(UnsupportedFormatError):
        detect_format(p)


def test_load_to_meta_device_keeps_dtype(tmp_path: Path) -> None:
    p = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(2, 2).bfloat16()}, str(p))
    with open_model(p) as r:
        t = r.load("w", torch.device("meta"))
    assert t.device.type == "meta" and t.dtype == torch.bfloat16


def test_unknown_tensor_name(tmp_path: Path) -> None:
    p = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(2, 2)}, str(p))
    with open_model(p) as r, pytest.raises(KeyError, match="nope"):
        r.load("nope", "cpu")


def test_truncated_npy(tmp_path: Path) -> None:
    p = tmp_path / "w.npy"
    np.save(p, np.ones((10, 10), np.float32))
    p.write_bytes(p.read_bytes()[:-4])
    with pytest.raises(MalformedInputError, match="'w'"):
        open_model(p)


def test_pytorch_names_clash_after_flattening(tmp_path: Path) -> None:
    p = tmp_path / "m.pt"
    torch.save({"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}, p)
    with pytest.raises(MalformedInputError, match="appears twice"):
        open_model(p)


def test_safetensors_transient_loads_reuse_one_buffer(tmp_path: Path) -> None:
    ref = _ref_tensors()
    path = tmp_path / "m.safetensors"
    save_file(ref, str(path))
    with open_model(path) as r:
        for name, t in ref.items():  # every dtype and shape, empty included, through one growing buffer
            got = r.load_transient(name, "cpu")
            assert got.dtype == t.dtype and torch.equal(got, t), name
        a = r.load_transient("w32", "cpu")
        ptr = a.data_ptr()
        b = r.load_transient("w16", "cpu")  # smaller: the same memory, so a is no longer w32
        assert b.data_ptr() == ptr and torch.equal(b, ref["w16"])
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-8])
    with pytest.raises(MalformedInputError), open_model(tmp_path / "cut.safetensors") as r:
        for name in ref:
            r.load_transient(name, "cpu")
