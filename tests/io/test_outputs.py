"""The output-format registry: one name per format, the wire vocabulary derived from it, and every format
planned and checked before any work starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quantd.errors import ConfigError
from quantd.io import plan, quantize_file
from quantd.io.outputs import OutputFormat, format_names, get_format, register
from quantd.io.readers import TensorInfo
from quantd_client import QuantConfig
from quantd_client._dtypes import DIRECTORY_OUTPUT_FORMATS, OUTPUT_FORMATS


def test_registry_names_the_wire_formats() -> None:
    assert sorted(format_names()) == sorted(OUTPUT_FORMATS)
    assert {n for n in format_names() if get_format(n).writes_config} == set(DIRECTORY_OUTPUT_FORMATS)
    for name in format_names():
        fmt = get_format(name)
        assert isinstance(fmt, OutputFormat) and fmt.name == name and fmt.suffix.startswith(".")


def test_unknown_format_is_a_keyerror_naming_the_known_ones() -> None:
    with pytest.raises(KeyError, match="safetensors"):
        get_format("onnx")


def test_a_name_registers_once() -> None:
    cls = type(get_format("safetensors"))
    with pytest.raises(RuntimeError, match="twice"):
        register(cls)


def test_config_output_literal_follows_the_wire_formats() -> None:
    enum = QuantConfig.model_json_schema()["properties"]["output"]
    assert set(enum.get("enum", [enum.get("const")])) == set(OUTPUT_FORMATS)
    with pytest.raises(ValueError, match="output"):
        QuantConfig.model_validate({"output": "onnx"})


def test_plan_checks_the_format_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
    fmt = get_format("safetensors")

    def refuse(name: str, shape: tuple[int, ...], scheme: object) -> None:
        raise ConfigError("this format cannot hold it", tensor=name, field="scheme.dtype")

    monkeypatch.setattr(fmt, "check", refuse)
    with pytest.raises(ConfigError, match="'w'"):
        plan([TensorInfo("w", (8, 128), "float32", 8 * 128 * 4)], QuantConfig())


def test_safetensors_format_writes_the_v1_artifact(tmp_path: Path) -> None:
    src, dst = tmp_path / "m.safetensors", tmp_path / "out.safetensors"
    save_file({"w": torch.randn(16, 128), "b": torch.randn(16)}, str(src))
    report = quantize_file(src, dst, QuantConfig(output="safetensors"), device="cpu")
    from quantd.io import dequantize_artifact

    out = dequantize_artifact(dst)
    assert set(out) == {"w", "b"} and report.summary.tensors_quantized == 1
