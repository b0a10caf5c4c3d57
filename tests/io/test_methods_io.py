"""Methods through the file pipeline: calibration files, the artifact's float zero points, g_idx and
channel_scale (torch and NumPy readers agree with the engine), output_rel_error in the report."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from quantd.engine.methods import LayerHessian, quantize_tensor
from quantd.engine.primitives import dequantize
from quantd.errors import ConfigError, MalformedInputError
from quantd.io.artifact import dequantize_artifact, read_artifact_torch
from quantd.io.calibration import MethodCalibration
from quantd.io.pipeline import quantize_file
from quantd_client import QuantConfig
from quantd_client._artifact import read_artifact


def _model(tmp_path: Path) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    w = {"enc.q.weight": torch.randn(32, 128, generator=g), "enc.o.weight": torch.randn(16, 64, generator=g),
         "enc.o.bias": torch.randn(16, generator=g)}
    xq, xo = torch.randn(400, 128, generator=g), torch.randn(3, 100, 64, generator=g)
    xq[:, :3] *= 10
    save_file(w, tmp_path / "m.safetensors")
    # one module by its rows ([N, in], here with leading dims), the other by Hessian + count
    xo2 = xo.reshape(-1, 64)
    save_file({"enc.q.hessian": xq.T @ xq, "enc.q.hessian_count": torch.tensor(400), "enc.o": xo},
              tmp_path / "cal.safetensors")
    return tmp_path / "m.safetensors", tmp_path / "cal.safetensors", {"enc.q": xq, "enc.o": xo2}


@pytest.mark.parametrize(("method", "args", "extra"), [
    ("hqq", {}, None), ("gptq", {"act_order": True}, "g_idx"), ("awq", {}, "channel_scale"), ("rtn", {}, None)])
def test_methods_artifact_roundtrip_and_report(tmp_path: Path, method: str, args: dict[str, bool],
                                               extra: str | None) -> None:
    src, cal, rows = _model(tmp_path)
    config = QuantConfig.model_validate(
        {"scheme": {"dtype": "int4", "group_size": 32, "method": method, "method_args": args}})
    report = quantize_file(src, tmp_path / "out.safetensors", config, device="cpu", calibration=cal)
    art = read_artifact(tmp_path / "out.safetensors")
    meta = art.metadata["tensors"]["enc.q.weight"]
    assert meta["method"] == method
    assert meta.get("zero_point_domain", "int") == ("float" if method == "hqq" else "int")
    if method == "hqq":
        assert art.raw("enc.q.weight.zero_point").dtype == np.float16
    for name in ("enc.q.weight", "enc.o.weight"):
        assert (f"{name}.{extra}" in art.tensor_names) if extra else not any(
            f"{name}.{e}" in art.tensor_names for e in ("g_idx", "channel_scale"))
    if extra == "g_idx":
        assert art.raw("enc.q.weight.g_idx").dtype == np.int32
    numpy_deq = art.dequantize()
    torch_deq = dequantize_artifact(tmp_path / "out.safetensors", dtype=torch.float32)
    assert set(numpy_deq) == set(torch_deq) == {"enc.q.weight", "enc.o.weight", "enc.o.bias"}
    for name, t in torch_deq.items():
        np.testing.assert_array_equal(numpy_deq[name], t.numpy())
    by_name = {t.name: t for t in report.tensors}
    for name, module in (("enc.q.weight", "enc.q"), ("enc.o.weight", "enc.o")):
        stats = by_name[name].stats
        assert stats is not None and stats.output_rel_error is not None
        x = rows[module].double()
        from safetensors.torch import load_file

        w = load_file(src)[name].double()
        y, y_hat = x @ w.T, x @ torch_deq[name].double().T
        assert stats.output_rel_error == pytest.approx(float((y - y_hat).square().sum() / y.square().sum()),
                                                       rel=1e-3)
    qts = read_artifact_torch(tmp_path / "out.safetensors")
    assert (qts["enc.q.weight"].g_idx is not None) == (extra == "g_idx")
    assert (qts["enc.q.weight"].channel_scale is not None) == (extra == "channel_scale")


def test_engine_result_equals_the_artifact_decoding(tmp_path: Path) -> None:
    """The artifact's NumPy dequantization is the engine's dequantize of the same QuantizedTensor."""
    src, cal, rows = _model(tmp_path)
    x = rows["enc.q"]
    from safetensors.torch import load_file

    w = load_file(src)["enc.q.weight"]
    qt = quantize_tensor(w, QuantConfig.model_validate(
        {"scheme": {"dtype": "int3", "group_size": 32, "method": "gptq", "method_args": {"act_order": True}}}).scheme,
        name="enc.q.weight", calibration=LayerHessian(x.T @ x, 400))
    config = QuantConfig.model_validate({"scheme": {"dtype": "int3", "group_size": 32, "method": "gptq",
                                                    "method_args": {"act_order": True}},
                                         "rules": [{"match": "enc.o.*", "skip": True}]})
    quantize_file(src, tmp_path / "o.safetensors", config, device="cpu", calibration=cal)
    got = read_artifact(tmp_path / "o.safetensors").dequantize("enc.q.weight")["enc.q.weight"]
    np.testing.assert_allclose(got, dequantize(qt).numpy(), rtol=1e-6, atol=1e-6)


def test_calibration_problems_fail_before_any_work(tmp_path: Path) -> None:
    src, _, _ = _model(tmp_path)
    gptq = QuantConfig.model_validate({"scheme": {"dtype": "int4", "group_size": 32, "method": "gptq"}})
    with pytest.raises(ConfigError, match=r"tensor 'enc.o.weight'.*needs calibration"):  # the first in the file
        quantize_file(src, tmp_path / "o.safetensors", gptq, device="cpu")
    save_file({"enc.q": torch.randn(10, 128)}, tmp_path / "partial.safetensors")
    with pytest.raises(ConfigError, match=r"tensor 'enc.o.weight'.*needs calibration"):
        quantize_file(src, tmp_path / "o.safetensors", gptq, device="cpu", calibration=tmp_path / "partial.safetensors")
    save_file({"enc.q": torch.randn(10, 100), "enc.o": torch.randn(10, 64)}, tmp_path / "wide.safetensors")
    with pytest.raises(ConfigError, match=r"tensor 'enc.q.weight'.*100 input features"):
        quantize_file(src, tmp_path / "o.safetensors", gptq, device="cpu", calibration=tmp_path / "wide.safetensors")
    save_file({"enc.q.hessian": torch.eye(128)}, tmp_path / "nocount.safetensors")
    with pytest.raises(MalformedInputError, match="hessian_count"):
        MethodCalibration.describe(tmp_path / "nocount.safetensors")
    assert not (tmp_path / "o.safetensors").exists()


def test_calibration_values_are_checked_in_chunks_naming_the_tensor(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from quantd.errors import NonFiniteError
    from quantd.io import calibration

    monkeypatch.setattr(calibration, "_CHECK_CHUNK", 1000)  # a NaN in the last of many chunks is found
    x = torch.randn(300, 48, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(torch.bfloat16)
    good = {"a": x, "b.hessian": (x.float().T @ x.float()), "b.hessian_count": torch.tensor(300)}
    save_file(good, tmp_path / "good.safetensors")
    assert set(MethodCalibration.describe(tmp_path / "good.safetensors")) == {"a", "b"}
    bad_rows = x.clone()
    bad_rows[-1, -1] = float("inf")
    save_file({**good, "a": bad_rows}, tmp_path / "rows.safetensors")
    with pytest.raises(NonFiniteError, match=r"'a' has NaN or Inf values \(1 of 14400\)") as e:
        MethodCalibration.describe(tmp_path / "rows.safetensors")
    assert e.value.tensor == "a"
    h = good["b.hessian"].clone()
    h[47, 47] = -0.5
    save_file({**good, "b.hessian": h}, tmp_path / "diag.safetensors")
    with pytest.raises(MalformedInputError, match=r"'b.hessian'.*1 of its 48 diagonal entries are negative"):
        MethodCalibration.describe(tmp_path / "diag.safetensors")
    save_file({**good, "b.hessian_count": torch.tensor(0)}, tmp_path / "count.safetensors")
    with pytest.raises(MalformedInputError, match=r"'b.hessian_count'.*≥ 1, got 0"):
        MethodCalibration.describe(tmp_path / "count.safetensors")
    with (MethodCalibration(tmp_path / "diag.safetensors") as cal,  # the worker refuses it the same way
          pytest.raises(MalformedInputError, match="diagonal")):
        cal.layer("b.weight", torch.device("cpu"))


def test_rows_and_hessian_calibration_agree(tmp_path: Path) -> None:
    x = torch.randn(300, 48, generator=torch.Generator().manual_seed(3))
    save_file({"a": x, "b.hessian": x.T @ x, "b.hessian_count": torch.tensor(300)}, tmp_path / "c.safetensors")
    with MethodCalibration(tmp_path / "c.safetensors") as cal:
        a, b = cal.layer("a.weight", torch.device("cpu")), cal.layer("b.weight", torch.device("cpu"))
        assert a is not None and b is not None and cal.layer("c.weight", torch.device("cpu")) is None
    assert a.count == b.count == 300
    torch.testing.assert_close(a.hessian, b.hessian, rtol=1e-5, atol=1e-3)


def test_artifact_metadata_names_method_args(tmp_path: Path) -> None:
    src, _, _ = _model(tmp_path)
    config = QuantConfig.model_validate({"scheme": {"dtype": "int4", "group_size": 32, "method": "hqq",
                                                    "method_args": {"iters": 5}}})
    quantize_file(src, tmp_path / "o.safetensors", config, device="cpu")
    meta = json.loads(read_artifact(tmp_path / "o.safetensors").raw_metadata["quantd"])
    assert meta["tensors"]["enc.q.weight"]["method_args"] == {"iters": 5}


def test_gptq_act_order_into_compressed_tensors_writes_g_idx(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from quantd.io.model_dir import ModelFiles, quantize_directory

    src, cal, _ = _model(tmp_path)
    files = ModelFiles({"model.safetensors": src})
    config = QuantConfig.model_validate({"output": "compressed-tensors", "scheme": {
        "dtype": "int4", "group_size": 32, "method": "gptq",
        "method_args": {"act_order": True, "static_groups": False}}})  # the column order asked for
    report = quantize_directory(files, tmp_path / "out", config, device="cpu", calibration=cal)
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert out["enc.q.weight_g_idx"].dtype == torch.int32 and out["enc.q.weight_g_idx"].shape == (128,)
    assert sorted(torch.bincount(out["enc.q.weight_g_idx"].long()).tolist()) == [32] * 4
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] == "group"
    assert all(t.stats.output_rel_error is not None for t in report.tensors if t.stats)
    awq = config.model_copy(update={"scheme": config.scheme.model_copy(update={"method": "awq", "method_args": {}})})
    with pytest.raises(ConfigError, match="per-input-channel scales"):
        quantize_directory(files, tmp_path / "out2", awq, device="cpu", calibration=cal)
    with pytest.raises(ConfigError, match="needs calibration"):
        quantize_directory(files, tmp_path / "out3", config, device="cpu")
