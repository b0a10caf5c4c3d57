"""``quantd quantize MODEL_DIR -o OUT_DIR``: in-process and through ``--server``, the same directory out."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantd.cli import main


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    root = tmp_path / "model"
    root.mkdir()
    g = torch.Generator().manual_seed(5)
    save_file({"l0.weight": torch.randn(32, 64, generator=g), "l0.bias": torch.zeros(32)},
              str(root / "model-00001-of-00002.safetensors"))
    save_file({"l1.weight": torch.randn(16, 64, generator=g)}, str(root / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"l0.weight": "model-00001-of-00002.safetensors", "l0.bias": "model-00001-of-00002.safetensors",
                            "l1.weight": "model-00002-of-00002.safetensors"}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "config.json").write_text(json.dumps({"model_type": "not-a-real-architecture"}))
    (root / "README.md").write_text("# a model\n")
    return root


def tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in root.rglob("*") if p.is_file()}


ARGS = ["--format", "compressed-tensors", "--dtype", "int4", "--group-size", "32", "--symmetric", "--json"]


def test_a_model_directory_in_process(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["quantize", str(model_dir), "-o", str(out), "--device", "cpu", *ARGS]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["summary"]["tensors_quantized"] == 2 and len(report["tensors"]) == 3
    assert set(tree(out)) == set(tree(model_dir))
    assert (out / "README.md").read_text() == "# a model\n"
    config = json.loads((out / "config.json").read_text())
    # An architecture transformers does not know: every 2-D *.weight is a Linear weight, named one by one.
    groups = config["quantization_config"]["config_groups"]
    assert groups["group_0"]["targets"] == ["l0", "l1"]
    assert load_file(str(out / "model-00002-of-00002.safetensors"))["l1.weight_packed"].dtype == torch.int32
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["l1.weight_scale"] == "model-00002-of-00002.safetensors"
    assert main(["quantize", str(model_dir), "-o", str(out), "--device", "cpu", *ARGS]) == 1  # not over a result
    assert "exists" in capsys.readouterr().err


@pytest.mark.slow
def test_a_model_directory_through_the_server_gives_the_same_files(cli_server: str, model_dir: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    local, remote = tmp_path / "local", tmp_path / "remote"
    assert main(["quantize", str(model_dir), "-o", str(local), "--device", "cpu", *ARGS]) == 0
    capsys.readouterr()
    assert main(["quantize", str(model_dir), "-o", str(remote), "--server", cli_server, *ARGS]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["job_id"] and report["summary"]["tensors_quantized"] == 2
    assert tree(remote) == tree(local)  # byte-identical output, file by file


@pytest.mark.parametrize("through_server", [False, True], ids=["in-process", "server"])
def test_outputs_are_checked_before_any_work_in_both_modes(cli_server: str, model_dir: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str],
                                                           through_server: bool) -> None:
    """A model directory's output goes to an absent or empty directory, a file's output is not a directory:
    refused alike in-process and with --server, before a job is submitted."""
    import httpx

    server = ["--server", cli_server] if through_server else ["--device", "cpu"]
    before = httpx.get(f"{cli_server}/v1/jobs", params={"limit": 100}).json()["items"]
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "stale.txt").write_text("not the model's")
    assert main(["quantize", str(model_dir), "-o", str(taken), *server, *ARGS]) == 1
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert [p.name for p in taken.iterdir()] == ["stale.txt"]
    one = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(8, 32)}, str(one))
    assert main(["quantize", str(one), "-o", str(taken), "--dtype", "int8", *server]) == 1
    assert "is a directory" in capsys.readouterr().err
    assert httpx.get(f"{cli_server}/v1/jobs", params={"limit": 100}).json()["items"] == before  # nothing submitted
    (taken / "stale.txt").unlink()
    assert main(["quantize", str(model_dir), "-o", str(taken), *server, *ARGS]) == 0  # empty: fine
