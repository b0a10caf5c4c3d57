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
