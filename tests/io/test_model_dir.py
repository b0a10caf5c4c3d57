"""The model-directory pipeline: paths, PyTorch shards, the rewritten index, and nothing left behind by a
run that stops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quantd.errors import JobCancelled, MalformedInputError, QuantdError
from quantd.io.model_dir import PathError, check_relpath, output_relpath, quantize_directory
from quantd.server.problems import status_of
from quantd_client import QuantConfig

CONFIG = QuantConfig.model_validate({"scheme": {"dtype": "int8", "granularity": "channel", "symmetric": True}})


@pytest.mark.parametrize("path", ["config.json", "a/b/c.json", "model-00001-of-00002.safetensors", "dots..ok"])
def test_relative_paths_pass(path: str) -> None:
    assert check_relpath(path) == path


@pytest.mark.parametrize("path", ["", "/abs", "../up", "a/../b", "a//b", "./a", "a/.", "a\\b", "nul\x00", "del\x7f",
                                  "C:/x", "x" * 2000, "d/" + "x" * 300 + ".json", "é" * 128 + "/a.json"])
def test_bad_paths_are_refused_naming_them(path: str) -> None:
    with pytest.raises(PathError) as e:
        check_relpath(path)
    assert status_of(e.value) == 422 and e.value.field == "file"


def test_a_component_up_to_name_max_bytes_passes() -> None:
    name = "d/" + "x" * 250 + ".json"  # 255 bytes: the longest name a filesystem takes
    assert check_relpath(name) == name


@pytest.mark.parametrize(("index", "needle"), [
    ({"metadata": [1], "weight_map": {}}, '"metadata"'),
    ({"metadata": "x", "weight_map": {}}, '"metadata"'),
    ({"weight_map": {"a.weight": 1}}, '"weight_map"'),
    ({"weight_map": []}, '"weight_map"'),
    ([1, 2], "JSON object"),
])
def test_an_index_of_the_wrong_shape_is_refused_naming_the_field(tmp_path: Path, index: object, needle: str) -> None:
    from quantd.io.model_dir import ModelFiles, check_shards

    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    files = ModelFiles({"model.safetensors": tmp_path / "model.safetensors",
                        "model.safetensors.index.json": tmp_path / "model.safetensors.index.json"})
    with pytest.raises(MalformedInputError) as e:
        check_shards(files, {"model.safetensors": ["a.weight"]})
    assert "model.safetensors.index.json" in e.value.detail and needle in e.value.detail, e.value.detail
    assert status_of(e.value) == 422


def test_pytorch_shards_become_safetensors_shards(tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    torch.save({"a.weight": torch.randn(8, 32)}, src / "pytorch_model-00001-of-00002.bin")
    torch.save({"b.weight": torch.randn(8, 32), "b.bias": torch.zeros(8)}, src / "pytorch_model-00002-of-00002.bin")
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {
        "a.weight": "pytorch_model-00001-of-00002.bin", "b.weight": "pytorch_model-00002-of-00002.bin",
        "b.bias": "pytorch_model-00002-of-00002.bin"}}))
    report = quantize_directory(src, tmp_path / "out", CONFIG, device="cpu")
    assert report.summary.tensors_quantized == 2
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["model-00001-of-00002.safetensors",
                                                      "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["b.bias"] == "model-00002-of-00002.safetensors"
    assert set(load_file(str(out / "model-00002-of-00002.safetensors"))) == {
        n for n, s in index["weight_map"].items() if s == "model-00002-of-00002.safetensors"}
    assert output_relpath("sub/pytorch_model.bin") == "sub/model.safetensors"


def test_a_cancelled_run_leaves_nothing(tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    torch.save({"a.weight": torch.randn(8, 32), "b.weight": torch.randn(8, 32)}, src / "pytorch_model.bin")
    calls = iter([False, True])
    with pytest.raises(JobCancelled):
        quantize_directory(src, tmp_path / "out", CONFIG, device="cpu", should_cancel=lambda: next(calls))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_an_existing_output_directory_is_never_overwritten(tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    torch.save({"a.weight": torch.randn(8, 32)}, src / "model.pt")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError):
        quantize_directory(src, tmp_path / "out", CONFIG, device="cpu")
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep"


def test_a_directory_without_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "config.json").write_text("{}")
    with pytest.raises(MalformedInputError, match="no weight files"):
        quantize_directory(tmp_path / "in", tmp_path / "out", CONFIG, device="cpu")


@pytest.mark.parametrize(("content", "status"), [
    (b"not a weight file at all, just text", 415),
    (b"\x80\x02cos\nsystem\nq\x00X\x02\x00\x00\x00idq\x01\x85q\x02Rq\x03.", None),  # a pickle that runs code
])
def test_a_shard_refused_for_its_content_is_named(tmp_path: Path, content: bytes, status: int | None) -> None:
    src = tmp_path / "in"
    src.mkdir()
    torch.save({"a.weight": torch.randn(8, 8)}, src / "pytorch_model-00001-of-00002.bin")
    (src / "pytorch_model-00002-of-00002.bin").write_bytes(content)
    with pytest.raises(QuantdError) as e:
        quantize_directory(src, tmp_path / "out", CONFIG, device="cpu")
    assert e.value.detail.startswith("pytorch_model-00002-of-00002.bin: ")
    assert 400 <= status_of(e.value) < 500 and (status is None or status_of(e.value) == status)


def test_tar_window_finds_members_with_few_ranged_reads(tmp_path: Path) -> None:
    from quantd.io.model_dir import pack_tar, tar_window

    sources = []
    for i in range(40):
        p = tmp_path / f"f{i}.txt"
        p.write_bytes(bytes([i]) * (100 + i))
        sources.append((f"d/f{i}.txt", p))
    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * 200_000)
    manifest = pack_tar([*sources, ("big.bin", big)], tmp_path / "out.tar")
    data = (tmp_path / "out.tar").read_bytes()
    calls: list[tuple[int, int]] = []

    def read(start: int, length: int) -> bytes:
        calls.append((start, length))
        return data[start:start + length]

    for entry in manifest:
        calls.clear()
        window = tar_window(read, len(data), entry["path"])
        assert window is not None
        offset, size = window
        assert size == entry["bytes"] and data[offset:offset + size] == Path(dict(sources).get(
            entry["path"], big)).read_bytes()
        assert len(calls) <= 3  # headers of many small files share one read-ahead block
    assert tar_window(read, len(data), "missing.txt") is None


def test_declared_size_counts_layers_and_experts_but_not_limits() -> None:
    """config.json's counts must fit the weights (a tiny config cannot make transformers build 10⁵ layers);
    limits named like counts (Qwen2's max_window_layers, 28 whatever the depth) are not counts."""
    from quantd.errors import MalformedInputError
    from quantd.io.model_skeleton import check_declared_size

    shapes = [(64, 64)] * 9  # two layers' tensors, and an embedding
    check_declared_size({"num_hidden_layers": 2, "max_window_layers": 28, "sliding_window_layers": 40,
                         "hidden_size": 64}, shapes)
    with pytest.raises(MalformedInputError, match="num_hidden_layers is 100000"):
        check_declared_size({"num_hidden_layers": 100000}, shapes)
    with pytest.raises(MalformedInputError, match="num_local_experts is 4096"):
        check_declared_size({"text_config": {"num_local_experts": 4096}}, shapes)


def test_a_trainer_checkpoint_s_own_state_is_copied_never_loaded(tmp_path: Path) -> None:
    """A Trainer checkpoint folder holds pickles of its arguments, optimizer, scheduler and RNG beside the
    weights: they are not weights, so they are neither loaded (a pickle that would run code stays inert) nor
    refused, and come back byte for byte like the tokenizer."""
    import pickle

    from safetensors.torch import save_file

    src = tmp_path / "checkpoint-500"
    src.mkdir()
    save_file({"a.weight": torch.randn(8, 32)}, str(src / "model.safetensors"))
    marker = tmp_path / "PWNED"
    state = {"training_args.bin": pickle.dumps(_OpensAFile(marker)), "optimizer.pt": pickle.dumps({"lr": 1e-4}),
             "scheduler.pt": b"\x80\x04N.", "rng_state.pth": b"\x80\x04N.", "rng_state_3.pth": b"\x80\x04N."}
    for name, data in state.items():
        (src / name).write_bytes(data)
    report = quantize_directory(src, tmp_path / "out", CONFIG, device="cpu")
    assert report.summary.tensors_quantized == 1 and not marker.exists()
    for name, data in state.items():
        assert (tmp_path / "out" / name).read_bytes() == data


class _OpensAFile:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))
