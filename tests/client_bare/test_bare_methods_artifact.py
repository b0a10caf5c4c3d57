"""The SDK's NumPy dequantizer on the results of methods beyond round-to-nearest (CONTRACT §10): float zero
points in scale_dtype, a column order g_idx and per-input-channel channel_scale, with NumPy alone."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
import pytest

from quantd_client._artifact import ArtifactError, read_artifact

_ST = {np.dtype("float16"): "F16", np.dtype("float32"): "F32", np.dtype("int32"): "I32", np.dtype("uint8"): "U8",
       np.dtype("int8"): "I8"}


def _artifact(tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"quantd": json.dumps(meta)}}
    data, pos = b"", 0
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": _ST[arr.dtype], "shape": list(arr.shape), "data_offsets": [pos, pos + len(raw)]}
        data, pos = data + raw, pos + len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return len(h).to_bytes(8, "little") + h + data


def _meta(**extra: Any) -> dict[str, Any]:
    return {"format_version": 1, "tensors": {"w": {
        "dtype": "int8", "shape": [2, 4], "orig_dtype": "float32", "symmetric": False, "granularity": "group",
        "axis": 0, "group_size": 2, "method": "rtn", "observer": "minmax", **extra}}}


CODES = np.array([[1, -2, 3, 4], [0, 5, -6, 7]], dtype=np.int8)
SCALE = np.array([[0.5, 0.25], [1.0, 2.0]], dtype=np.float16)


@pytest.mark.skipif(os.environ.get("QUANTD_BARE") != "1", reason="only in the bare-install venv (QUANTD_BARE=1)")
def test_torch_is_not_imported() -> None:
    assert "torch" not in sys.modules


def test_float_zero_point_is_read_in_scale_dtype() -> None:
    zp = np.array([[0.5, -1.25], [2.75, 0.0]], dtype=np.float16)
    art = read_artifact(_artifact({"w.qdata": CODES, "w.scale": SCALE, "w.zero_point": zp},
                                  _meta(method="hqq", zero_point_domain="float")))
    want = (CODES.astype(np.float32) - np.repeat(zp.astype(np.float32), 2, axis=1)) * np.repeat(
        SCALE.astype(np.float32), 2, axis=1)
    np.testing.assert_array_equal(art.dequantize("w")["w"], want)
    assert want[0, 0] == 0.25  # (1 − 0.5) · 0.5: the fractional zero point was not truncated


def test_g_idx_picks_each_columns_group() -> None:
    zp = np.array([[1, 0], [0, -1]], dtype=np.int8)
    g_idx = np.array([1, 0, 0, 1], dtype=np.int32)
    art = read_artifact(_artifact({"w.qdata": CODES, "w.scale": SCALE, "w.zero_point": zp, "w.g_idx": g_idx},
                                  _meta(method="gptq")))
    want = np.empty((2, 4), np.float32)
    for r in range(2):
        for j in range(4):
            g = g_idx[j]
            want[r, j] = (int(CODES[r, j]) - int(zp[r, g])) * float(SCALE[r, g])
    np.testing.assert_array_equal(art.dequantize()["w"], want)
    bad = read_artifact(_artifact({"w.qdata": CODES, "w.scale": SCALE, "w.g_idx": np.array([0, 1, 2, 0], np.int32)},
                                  _meta(method="gptq", symmetric=True)))
    with pytest.raises(ArtifactError, match="g_idx"):
        bad.dequantize()


def test_channel_scale_divides_each_column() -> None:
    cs = np.array([2.0, 0.5, 1.0, 4.0], dtype=np.float32)
    art = read_artifact(_artifact({"w.qdata": CODES, "w.scale": SCALE, "w.channel_scale": cs},
                                  _meta(method="awq", symmetric=True)))
    want = CODES.astype(np.float32) * np.repeat(SCALE.astype(np.float32), 2, axis=1) / cs
    np.testing.assert_allclose(art.dequantize()["w"], want, rtol=1e-7)
    assert art.passthrough == []  # the method's tensors belong to w, not left over as plain tensors


@pytest.mark.parametrize(("name", "embedding"), [
    ("model.embed_tokens.weight", True), ("bert.embeddings.word_embeddings.weight", True), ("lm_head.weight", True),
    ("transformer.wte.weight", True), ("token_embd.weight", True), ("position_embd.weight", True),
    ("per_layer_token_embd.weight", True), ("output.weight", True),
    ("blk.0.attn_output.weight", False), ("encoder.layer.0.output.dense.weight", False),
    ("model.layers.0.mlp.down_proj.weight", False), ("blk.0.ffn_up.weight", False)])
def test_embedding_tables_and_heads_by_hugging_face_and_llama_cpp_names(name: str, embedding: bool) -> None:
    from quantd_client._schemas import QuantConfig, is_embedding

    assert is_embedding(name) is embedding
    gguf_name = name in ("token_embd.weight", "position_embd.weight", "per_layer_token_embd.weight", "output.weight")
    assert is_embedding(name, gguf_names=False) is (embedding and not gguf_name)
    # skip_embeddings: llama.cpp's names stay in a safetensors output; a GGUF output quantizes them as llama.cpp
    scheme, reason = QuantConfig().scheme_for(name, (64, 64))
    assert (scheme is None) is embedding and (reason is not None) is embedding
    gguf = QuantConfig.model_validate({"output": "gguf", "scheme": {"dtype": "q8_0"}})
    assert (gguf.scheme_for(name, (64, 64))[0] is None) is (embedding and not gguf_name)
