"""The quantd command's --method, --method-arg and --calibration, in-process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from quantd.cli import main
from quantd_client.calibration import write_safetensors

W = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32)


def test_quantize_with_gptq_and_a_calibration_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "m.npz"
    np.savez(src, **{"layer.weight": W})
    x = np.random.default_rng(2).standard_normal((300, 64)).astype(np.float32)
    cal = tmp_path / "cal.safetensors"
    write_safetensors(cal, {"layer.hessian": x.T @ x, "layer.hessian_count": np.asarray(300, np.int64)})
    out = tmp_path / "o.safetensors"
    assert main(["quantize", str(src), "-o", str(out), "--dtype", "int4", "--group-size", "32", "--method", "gptq",
                 "--method-arg", "act_order=true", "--method-arg", "damp=0.05", "--calibration", str(cal),
                 "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (w,) = report["tensors"]
    assert w["scheme"]["method"] == "gptq" and w["scheme"]["method_args"] == {"act_order": True, "damp": 0.05}
    assert 0.0 < w["stats"]["output_rel_error"] < 0.05


def test_method_arg_must_be_key_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "m.npz"
    np.savez(src, **{"layer.weight": W})
    assert main(["quantize", str(src), "-o", str(tmp_path / "o.safetensors"), "--method", "hqq",
                 "--method-arg", "iters"]) != 0
    assert "KEY=VALUE" in capsys.readouterr().err


def test_a_model_directory_with_jsonl_calibration_in_process_and_through_a_server(
        cli_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--calibration texts.jsonl`` runs the model on the lines; in-process and as a job, the same files."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from _tiny_models import sentences, tiny_llama, write_jsonl

    model = tiny_llama(tmp_path / "model")
    cal = write_jsonl(tmp_path / "texts.jsonl", [{"text": s} for s in sentences(12)])
    args = ["--dtype", "int4", "--group-size", "32", "--method", "gptq", "--calibration", str(cal),
            "--calibration-samples", "6", "--calibration-max-seq-len", "8", "--device", "cpu", "--json"]
    assert main(["quantize", str(model), "-o", str(tmp_path / "local"), *args]) == 0
    local = json.loads(capsys.readouterr().out)
    assert local["config"]["calibration"] == {"samples": 6, "max_seq_len": 8}
    errors = [t["stats"]["output_rel_error"] for t in local["tensors"] if t["stats"]]
    assert len(errors) == 21 and all(0.0 < e < 0.1 for e in errors)
    assert main(["quantize", str(model), "-o", str(tmp_path / "remote"), "--server", cli_server, *args]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert [t["stats"]["output_rel_error"] for t in remote["tensors"] if t["stats"]] == pytest.approx(errors, rel=1e-4)
    for name in ("config.json", "tokenizer.json"):
        assert (tmp_path / "remote" / name).read_bytes() == (tmp_path / "local" / name).read_bytes(), name
    from safetensors import safe_open

    with safe_open(str(tmp_path / "local" / "model.safetensors"), "np") as a, \
            safe_open(str(tmp_path / "remote" / "model.safetensors"), "np") as b:
        assert set(a.keys()) == set(b.keys())
