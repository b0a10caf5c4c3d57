"""Model-aware calibration (CONTRACT §10): JSONL lines run through a model directory block by block.

Tiny models are built here with ``from_config`` and ``save_pretrained`` (a word-level tokenizer made with the
``tokenizers`` library): nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from quantd.engine.primitives import dequantize
from quantd.errors import ConfigError, MalformedInputError
from quantd.io import load_into_model
from quantd.io.model_calibration import _Weights, plan_text_calibration
from quantd.io.model_dir import ModelFiles, quantize_directory
from quantd.io.model_skeleton import Fold, apply_fold, block_folds, build_model, find_blocks
from quantd.io.text_calibration import is_jsonl, read_jsonl
from quantd_client import QuantConfig

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from _tiny_models import (
    LLAMA,
    AutoModel,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    id_rows,
    sentences,
    tiny_bert,
    tiny_llama,
    write_jsonl,
)

pytestmark = pytest.mark.usefixtures("hf_offline")


GPTQ = {"scheme": {"dtype": "int4", "group_size": 32, "method": "gptq"}, "calibration": {"samples": 16}}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("llama") / "model")


# --- the skeleton and its folds ------------------------------------------------------------------------------


def test_blocks_are_the_longest_list_of_one_class(llama_dir: Path) -> None:
    cfg = json.loads((llama_dir / "config.json").read_text())
    model = build_model(cfg, real_buffers=True)
    name, blocks = find_blocks(model)
    assert name == "model.layers" and len(blocks) == 3
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(b.device.type != "meta" for b in model.buffers())  # rotary frequencies computed for real
    assert block_folds(blocks[0]) == [
        Fold("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        Fold("self_attn.v_proj", ("self_attn.o_proj",)), Fold("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        Fold("mlp.up_proj", ("mlp.down_proj",))]


def test_a_norm_that_does_not_multiply_by_its_weight_takes_no_fold() -> None:
    cfg = {"model_type": "gemma", "architectures": ["GemmaForCausalLM"], "vocab_size": 48, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
           "head_dim": 16}
    _, blocks = find_blocks(build_model(cfg, real_buffers=False))
    sources = [f.source for f in block_folds(blocks[0])]
    assert "input_layernorm" not in sources and "post_attention_layernorm" not in sources  # x·(1 + w)
    assert "self_attn.v_proj" in sources and "mlp.up_proj" in sources


def test_grouped_query_attention_keeps_v_and_o_apart(tmp_path: Path) -> None:
    cfg = {**LLAMA, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_key_value_heads": 2}
    _, blocks = find_blocks(build_model(cfg, real_buffers=False))
    assert "self_attn.v_proj" not in [f.source for f in block_folds(blocks[0])]


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_folding_scales_leaves_the_model_unchanged(tmp_path: Path, kind: str) -> None:
    """Every fold applied with random scales in float: the model's outputs stay what they were."""
    path = tiny_llama(tmp_path / "m", seed=3) if kind == "llama" else tiny_bert(tmp_path / "m", seed=3)
    model = AutoModel.from_pretrained(str(path)).eval()
    ids = torch.tensor([[2, 5, 9, 14, 3, 7, 11, 20]])
    with torch.no_grad():
        before = model(input_ids=ids).last_hidden_state
        _, blocks = find_blocks(model)
        folds = block_folds(blocks[0])
        assert folds, "no fold found"
        g = torch.Generator().manual_seed(1)
        changed = 0
        for block in blocks:
            for fold in folds:
                s = torch.rand(block.get_submodule(fold.consumers[0]).in_features, generator=g) * 1.5 + 0.5
                apply_fold(block, fold, s)
                changed += 1
        after = model(input_ids=ids).last_hidden_state
    assert changed >= len(blocks)
    assert torch.allclose(after, before, rtol=1e-4, atol=1e-5), (after - before).abs().max()


# --- JSONL -------------------------------------------------------------------------------------------------


def test_jsonl_is_told_by_its_content(tmp_path: Path) -> None:
    assert is_jsonl(write_jsonl(tmp_path / "cal.bin", [{"text": "the cat"}]))
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf\n  {\"text\": \"x\"}\n")
    assert is_jsonl(tmp_path / "bom.txt")
    from safetensors.torch import save_file

    save_file({"m": torch.zeros(2, 2)}, str(tmp_path / "cal.jsonl"))
    assert not is_jsonl(tmp_path / "cal.jsonl")  # a safetensors file, whatever its name


@pytest.mark.parametrize(("content", "words"), [
    ('{"text": "a"}\n[1, 2]\n', ["line 2", "JSON object"]),
    ('{"text": "a"}\n{"text": "b", "input_ids": [1]}\n', ["line 2", "exactly one"]),
    ('\n{"text": ""}\n', ["line 2", "non-empty"]),
    ('{"input_ids": [1, true]}\n', ["line 1", "not an integer"]),
    ('{"input_ids": [3, 48]}\n', ["line 1", "token id 48", "vocabulary of 48"]),
    ('{"input_ids": []}\n', ["line 1", "non-empty list"]),
    ('{"text": "a"}\n{"txt": "b"}\n', ["line 2", "unknown keys"]),
    ('{"text": "a"\n', ["line 1", "not JSON"]),
    ('{"input_ids": ' + "[" * 100_000 + "]" * 100_000 + "}\n", ["line 1", "nested too deeply"]),
    ("\n\n", ["no lines"]),
    ('{"text": "a"}\n{"text": "b \\ud800 c"}\n', ["line 2", "lone surrogate"]),  # no tokenizer takes it
])
def test_bad_lines_are_named(tmp_path: Path, content: str, words: list[str]) -> None:
    (tmp_path / "c.jsonl").write_text(content)
    with pytest.raises(ConfigError) as e:
        read_jsonl(tmp_path / "c.jsonl", vocab_size=48)
    assert e.value.field == "calibration"
    assert all(w in e.value.detail for w in words), e.value.detail


def test_a_line_too_long_is_refused_without_reading_it_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import quantd.io.text_calibration as tc

    monkeypatch.setattr(tc, "MAX_LINE_BYTES", 100)
    (tmp_path / "c.jsonl").write_text('{"text": "ok"}\n{"text": "' + "x" * 500 + '"}\n')
    with pytest.raises(ConfigError, match="line 2: longer than 100 bytes"):
        read_jsonl(tmp_path / "c.jsonl")


@pytest.mark.parametrize(("case", "words"), [
    ("unknown architecture", ["model_type 'no-such-model'"]),
    ("no config.json", ["config.json"]),
    ("no tokenizer", ["need a tokenizer"]),
    ("missing weight", ["model.layers.2.mlp.down_proj.weight", "in no weight file"]),
    ("encoder-decoder", ["T5ForConditionalGeneration", "encoder-decoder"]),
])
def test_models_that_cannot_run_are_refused(tmp_path: Path, case: str, words: list[str]) -> None:
    from safetensors.torch import load_file, save_file

    path = tiny_llama(tmp_path / "m", tokenizer=case != "no tokenizer")
    if case == "unknown architecture":
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "model_type": "no-such-model",
                                                      "architectures": ["NoSuchModel"], "auto_map": {"AutoModel": "x.Y"}}))
    elif case == "encoder-decoder":
        (path / "config.json").write_text(json.dumps({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"],
                                                      "d_model": 32, "d_ff": 64, "num_layers": 1, "num_heads": 2,
                                                      "d_kv": 16, "vocab_size": 48}))
    elif case == "no config.json":
        (path / "config.json").unlink()
    elif case == "missing weight":
        st = load_file(str(path / "model.safetensors"))
        del st["model.layers.2.mlp.down_proj.weight"]
        save_file(st, str(path / "model.safetensors"))
    cal = write_jsonl(tmp_path / "c.jsonl", [{"text": "the cat sat"}])
    with pytest.raises(ConfigError) as e:
        plan_text_calibration(ModelFiles.from_dir(path), QuantConfig.model_validate(GPTQ), cal)
    assert all(w in e.value.detail for w in words), e.value.detail


@pytest.mark.parametrize(("key", "value", "words"), [
    ("num_hidden_layers", 100_000, ["num_hidden_layers is 100000", "tensors"]),
    ("intermediate_size", 10**7, ["intermediate_size is 10000000", "the largest is"]),
    ("num_local_experts", 10**6, ["num_local_experts is 1000000"]),
])
@pytest.mark.parametrize("path_kind", ["jsonl calibration", "compressed-tensors output"])
def test_a_config_far_larger_than_its_weights_is_refused_before_it_is_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str, value: int, words: list[str], path_kind: str) -> None:
    """A few bytes of config.json could declare a model whose mere skeleton takes minutes and gigabytes."""
    from quantd.io import model_skeleton
    from quantd.io.model_dir import plan_directory

    path = tiny_llama(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, key: value}))

    def no_build(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the architecture was built")

    monkeypatch.setattr(model_skeleton, "build_model", no_build)
    monkeypatch.setattr("quantd.io.model_calibration.build_model", no_build)
    files = ModelFiles.from_dir(path)
    with pytest.raises(MalformedInputError) as e:
        if path_kind == "jsonl calibration":
            plan_text_calibration(files, QuantConfig.model_validate(GPTQ), write_jsonl(tmp_path / "c.jsonl", id_rows(2)))
        else:
            plan_directory(files, QuantConfig.model_validate({"scheme": {"dtype": "int4", "group_size": 32},
                                                              "output": "compressed-tensors"}))
    assert all(w in e.value.detail for w in ["config.json", *words]), e.value.detail


def test_buffers_beyond_the_limit_are_refused_before_they_are_computed() -> None:
    """GPT-Neo keeps a [positions, positions] causal mask: a config with 2**17 positions would allocate 16 GiB."""
    cfg = {"model_type": "gpt_neo", "architectures": ["GPTNeoForCausalLM"], "hidden_size": 32, "num_layers": 2,
           "num_heads": 2, "attention_types": [[["global", "local"], 1]], "vocab_size": 64,
           "max_position_embeddings": 1 << 17, "window_size": 16, "bos_token_id": 0, "eos_token_id": 0}
    with pytest.raises(ConfigError, match="bytes of buffers"):
        build_model(cfg, real_buffers=True)
    assert build_model({**cfg, "max_position_embeddings": 64}, real_buffers=True) is not None


def test_a_config_with_auto_map_runs_transformers_own_class(tmp_path: Path) -> None:
    path = tiny_llama(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["MyLlama"],
                                                  "auto_map": {"AutoModelForCausalLM": "modeling_my.MyLlama"}}))
    (path / "modeling_my.py").write_text("raise SystemExit('remote code ran')\n")
    checked = plan_text_calibration(ModelFiles.from_dir(path), QuantConfig.model_validate(GPTQ),
                                    write_jsonl(tmp_path / "c.jsonl", id_rows(2)))
    assert type(checked.model.model).__name__ == "LlamaForCausalLM"


def _transformers_logits_cosine(out: Path, original: Path) -> float:
    """The cosine of the logits of ``out`` loaded by transformers (compressed-tensors) against the original
    model's, on one sequence."""
    model = AutoModelForCausalLM.from_pretrained(str(out))
    ref = AutoModelForCausalLM.from_pretrained(str(original))
    ids = torch.tensor([[2, 3, 4, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, ref(input_ids=ids).logits
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


# --- the run ------------------------------------------------------------------------------------------------


def test_gptq_on_text_lines_writes_every_linear_with_its_output_error(llama_dir: Path, tmp_path: Path) -> None:
    cal = write_jsonl(tmp_path / "c.jsonl", [{"text": s} for s in sentences(20)])
    config = QuantConfig.model_validate({**GPTQ, "rules": [{"match": "lm_head.*", "scheme": {"dtype": "int8",
                                                                                            "granularity": "channel"}}]})
    report = quantize_directory(llama_dir, tmp_path / "out", config, device="cpu", calibration=cal)
    quantized = {t.name: t for t in report.tensors if t.stats is not None}
    assert len(quantized) == 3 * 7 + 1  # every Linear of the blocks, and the head (its inputs from the replay)
    for t in quantized.values():
        assert t.stats is not None and t.stats.output_rel_error is not None
        assert 0.0 < t.stats.output_rel_error < 0.1, (t.name, t.stats.output_rel_error)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    result = load_into_model(model, tmp_path / "out" / "model.safetensors")
    assert not result.missing_keys and not result.unexpected_keys
    original = LlamaForCausalLM.from_pretrained(str(llama_dir))
    ids = torch.tensor([[2, 3, 4, 5, 6, 7]])
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, original(input_ids=ids).logits
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.9
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (llama_dir / "tokenizer.json").read_bytes()


def test_lines_longer_than_the_models_positions_are_cut_there(tmp_path: Path) -> None:
    """A max_seq_len past max_position_embeddings ran BERT past its position table (a torch error)."""
    path = tiny_bert(tmp_path / "bert")
    positions = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    cal = write_jsonl(tmp_path / "c.jsonl", [{"input_ids": [2 + i % 40 for i in range(positions + 50)]},
                                             {"text": " ".join(sentences(60))}])
    config = QuantConfig.model_validate({**GPTQ, "calibration": {"samples": 2, "max_seq_len": 4 * positions}})
    report = quantize_directory(path, tmp_path / "out", config, device="cpu", calibration=cal)
    assert all(t.stats is None or t.stats.output_rel_error is not None for t in report.tensors)


def test_each_blocks_inputs_come_from_the_quantized_blocks_before_it(llama_dir: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hessian GPTQ gets for block 1 is that of the model whose block 0 is already quantized, not the
    float model's."""
    import quantd.engine.methods as methods

    seen: dict[str, Any] = {}
    real = methods.quantize_tensor

    def spy(x: torch.Tensor, scheme: Any, *, name: str = "tensor", calibration: Any = None) -> Any:
        qt = real(x, scheme, name=name, calibration=calibration)
        seen[name] = (calibration.hessian.clone(), calibration.count, dequantize(qt))
        return qt

    monkeypatch.setattr(methods, "quantize_tensor", spy)
    rows = id_rows(12)
    quantize_directory(llama_dir, tmp_path / "out", QuantConfig.model_validate(GPTQ), device="cpu",
                       calibration=write_jsonl(tmp_path / "c.jsonl", rows))
    target = "model.layers.1.self_attn.q_proj.weight"
    got, count, _ = seen[target]
    assert count == sum(len(r["input_ids"]) for r in rows)  # the real tokens, not the padding

    def hessian(model: Any) -> torch.Tensor:
        h = torch.zeros(64, 64)

        def pre(mod: Any, args: Any) -> None:
            x = args[0].reshape(-1, 64)
            h.addmm_(x.T, x)

        handle = model.model.layers[1].self_attn.q_proj.register_forward_pre_hook(pre)
        with torch.no_grad():
            for r in rows:
                model(input_ids=torch.tensor([r["input_ids"]]))
        handle.remove()
        return h

    model = LlamaForCausalLM.from_pretrained(str(llama_dir)).eval()
    float_h = hessian(model)
    with torch.no_grad():
        for name, mod in model.model.layers[0].named_modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.copy_(seen[f"model.layers.0.{name}.weight"][2])
    sequential_h = hessian(model)
    scale = sequential_h.abs().max()
    assert (got - sequential_h).abs().max() / scale < 1e-4
    assert (got - float_h).abs().max() / scale > 1e-3  # the float model's inputs differ measurably


def test_padding_stays_out_of_hessians_whose_inputs_are_flattened(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT's MLP takes the batch as ``[B·T, H]`` rows: its Hessians count the real tokens only, as the
    attention projections' ``[B, T, H]`` inputs do, and equal those of the model run line by line."""
    from transformers import OPTConfig, OPTForCausalLM

    import quantd.engine.methods as methods

    torch.manual_seed(0)
    src = tmp_path / "opt"
    OPTForCausalLM(OPTConfig(vocab_size=48, hidden_size=64, ffn_dim=128, num_hidden_layers=1,
                             num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64)
                   ).save_pretrained(str(src))
    seen: dict[str, Any] = {}
    real = methods.quantize_tensor

    def spy(x: torch.Tensor, scheme: Any, *, name: str = "tensor", calibration: Any = None) -> Any:
        seen[name] = (calibration.hessian.clone(), calibration.count)
        return real(x, scheme, name=name, calibration=calibration)

    monkeypatch.setattr(methods, "quantize_tensor", spy)
    rows = id_rows(10)  # lines of 3 to 11 tokens: one padded batch
    quantize_directory(src, tmp_path / "out", QuantConfig.model_validate(GPTQ), device="cpu",
                       calibration=write_jsonl(tmp_path / "c.jsonl", rows))
    model = OPTForCausalLM.from_pretrained(str(src)).eval()
    h = torch.zeros(64, 64)

    def pre(mod: Any, args: Any) -> None:
        x = args[0].reshape(-1, 64)
        h.addmm_(x.T, x)

    handle = model.model.decoder.layers[0].fc1.register_forward_pre_hook(pre)
    with torch.no_grad():
        for r in rows:
            model(input_ids=torch.tensor([r["input_ids"]]))
    handle.remove()
    got, count = seen["model.decoder.layers.0.fc1.weight"]
    assert count == sum(len(r["input_ids"]) for r in rows) == seen["model.decoder.layers.0.self_attn.q_proj.weight"][1]
    assert (got - h).abs().max() / h.abs().max() < 1e-4


def test_a_checkpoint_whose_keys_transformers_renames_on_load_runs(tmp_path: Path) -> None:
    """GPT-NeoX checkpoints store the output layer as ``embed_out`` (the module is ``lm_head`` in transformers
    5): the worker maps the checkpoint's keys as transformers' loader does, and the output keeps them."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    src = tmp_path / "neox"
    GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64)).save_pretrained(str(src))
    config = {**GPTQ, "output": "compressed-tensors", "scheme": {**GPTQ["scheme"], "symmetric": True}}
    report = quantize_directory(src, tmp_path / "out", QuantConfig.model_validate(config), device="cpu",
                                calibration=write_jsonl(tmp_path / "c.jsonl", id_rows(8)))
    done = [t for t in report.tensors if not t.skipped]
    assert len(done) == 8 and all(t.stats.output_rel_error is not None for t in done)
    ref = AutoModelForCausalLM.from_pretrained(str(src)).eval()
    out = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = torch.tensor([id_rows(1, seed=3)[0]["input_ids"]])
    with torch.no_grad():
        a, b = ref(input_ids=ids).logits.flatten(), out(input_ids=ids).logits.flatten()
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.9


def test_a_model_whose_experts_transformers_merges_on_load_is_refused_saying_so(tmp_path: Path) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    src = tmp_path / "moe"
    MixtralForCausalLM(MixtralConfig(vocab_size=48, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=4, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)).save_pretrained(str(src))
    with pytest.raises(ConfigError, match="built by transformers from several checkpoint tensors"):
        plan_text_calibration(ModelFiles.from_dir(src), QuantConfig.model_validate(GPTQ),
                              write_jsonl(tmp_path / "c.jsonl", id_rows(4)))


def test_awq_folds_into_norms_and_projections_and_compressed_tensors_holds_it(llama_dir: Path, tmp_path: Path) -> None:
    config = QuantConfig.model_validate({"output": "compressed-tensors", "calibration": {"samples": 16},
                                         "scheme": {"dtype": "int4", "group_size": 32, "symmetric": True,
                                                    "method": "awq", "method_args": {"grid": 8}}})
    out = tmp_path / "out"
    report = quantize_directory(llama_dir, out, config, device="cpu",
                                calibration=write_jsonl(tmp_path / "c.jsonl", id_rows(16)))
    assert sum(t.stats is not None for t in report.tensors) == 3 * 7
    from safetensors.torch import load_file

    written = load_file(str(out / "model.safetensors"))
    original = load_file(str(llama_dir / "model.safetensors"))
    assert not any(k.endswith("channel_scale") for k in written)
    norm = "model.layers.0.input_layernorm.weight"
    assert written[norm].dtype == original[norm].dtype and not torch.equal(written[norm], original[norm])
    assert torch.equal(written["model.norm.weight"], original["model.norm.weight"])  # outside the blocks
    assert _transformers_logits_cosine(out, llama_dir) > 0.9


def test_unfoldable_awq_weights_keep_channel_scale_and_compressed_tensors_refuses_them(tmp_path: Path) -> None:
    path = tiny_llama(tmp_path / "m", num_key_value_heads=2)  # grouped-query attention: o_proj has no source
    cal = write_jsonl(tmp_path / "c.jsonl", id_rows(4))
    awq = {"scheme": {"dtype": "int4", "group_size": 32, "method": "awq"}}
    with pytest.raises(ConfigError, match=r"o_proj.*no layer before this weight that its AWQ scales fold into"):
        plan_text_calibration(ModelFiles.from_dir(path), QuantConfig.model_validate(
            {**awq, "output": "compressed-tensors"}), cal)
    checked = plan_text_calibration(ModelFiles.from_dir(path), QuantConfig.model_validate(awq), cal)
    outputs = {o.name for ps in checked.plans.values() for p in ps for o in p.outputs}
    assert "model.layers.0.self_attn.o_proj.weight.channel_scale" in outputs
    assert "model.layers.0.self_attn.q_proj.weight.channel_scale" not in outputs


def test_one_block_of_weights_is_loaded_at_a_time(llama_dir: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """At any time the parameters loaded are one block's, or the modules outside the blocks that one pass
    runs: the embedding table before the blocks, the head after them, never both."""
    snapshots: list[tuple[int, set[str]]] = []
    real = _Weights.load

    def load(self: _Weights, names: Any) -> None:
        real(self, names)
        live = {n for n, p in self.plan.model.named_parameters(remove_duplicate=False) if p.device.type != "meta"}
        snapshots.append((self.live, live))

    monkeypatch.setattr(_Weights, "load", load)
    config = {**GPTQ, "rules": [{"match": "lm_head.*", "scheme": {"dtype": "int8", "granularity": "channel"}}]}
    quantize_directory(llama_dir, tmp_path / "out", QuantConfig.model_validate(config), device="cpu",
                       calibration=write_jsonl(tmp_path / "c.jsonl", id_rows(4)))
    model = LlamaForCausalLM.from_pretrained(str(llama_dir))
    total = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    assert snapshots and max(n for n, _ in snapshots) <= block
    assert max(n for n, _ in snapshots) < total / 3
    assert any("lm_head.weight" in live for _, live in snapshots)  # the head ran (and was quantized)
    for _, live in snapshots:
        assert not ({"model.embed_tokens.weight", "lm_head.weight"} <= live)
        assert len({n.split(".")[2] for n in live if n.startswith("model.layers.")}) <= 1


def test_a_failing_run_leaves_no_output(llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import quantd.engine.methods as methods

    def boom(*a: Any, **k: Any) -> Any:
        raise RuntimeError("device lost")

    monkeypatch.setattr(methods, "quantize_tensor", boom)
    with pytest.raises(RuntimeError, match="device lost"):
        quantize_directory(llama_dir, tmp_path / "out", QuantConfig.model_validate(GPTQ), device="cpu",
                           calibration=write_jsonl(tmp_path / "c.jsonl", id_rows(4)))
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_a_bert_directory_calibrates_its_pooler_on_the_replayed_outputs(tmp_path: Path) -> None:
    path = tiny_bert(tmp_path / "bert")
    config = QuantConfig.model_validate({**GPTQ, "output": "compressed-tensors",
                                         "scheme": {**GPTQ["scheme"], "symmetric": True}})
    report = quantize_directory(path, tmp_path / "out", config, device="cpu",
                                calibration=write_jsonl(tmp_path / "c.jsonl", [{"text": s} for s in sentences(10)]))
    errors = {t.name: t.stats.output_rel_error for t in report.tensors if t.stats is not None}
    assert len(errors) == 2 * 6 + 1 and "pooler.dense.weight" in errors
    assert all(e is not None and 0.0 < e < 0.1 for e in errors.values()), errors
    model = AutoModel.from_pretrained(str(tmp_path / "out"))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[2, 3, 4, 5]]))
    assert torch.isfinite(out.pooler_output).all()


def test_a_cancelled_run_stops_between_blocks_and_leaves_no_output(llama_dir: Path, tmp_path: Path) -> None:
    from quantd.errors import JobCancelled

    asked = []

    def cancel_at_block_2() -> bool:
        asked.append(1)
        return len(asked) >= 2

    with pytest.raises(JobCancelled, match="block 1 of 3"):
        quantize_directory(llama_dir, tmp_path / "out", QuantConfig.model_validate(GPTQ), device="cpu",
                           calibration=write_jsonl(tmp_path / "c.jsonl", id_rows(4)), should_cancel=cancel_at_block_2)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize("static_groups", [None, False])
def test_act_order_gptq_to_compressed_tensors_loads_in_transformers(llama_dir: Path, tmp_path: Path,
                                                                     static_groups: bool | None) -> None:
    """Act-order GPTQ written as compressed-tensors keeps its groups contiguous unless the config asks for a
    column order: the library (0.20 and later) loads no ``weight_g_idx``, so by default the checkpoint has
    none and declares ``actorder: weight``; asked for, ``weight_g_idx`` is written with ``actorder: group``."""
    from safetensors.torch import load_file

    args: dict[str, Any] = {"act_order": True}
    if static_groups is not None:
        args["static_groups"] = static_groups
    config = QuantConfig.model_validate({"output": "compressed-tensors", "calibration": {"samples": 16},
                                         "scheme": {"dtype": "int4", "group_size": 32, "symmetric": True,
                                                    "method": "gptq", "method_args": args}})
    out = tmp_path / "out"
    quantize_directory(llama_dir, out, config, device="cpu",
                       calibration=write_jsonl(tmp_path / "c.jsonl", id_rows(16)))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    orders = {g["weights"]["actorder"] for g in qc["config_groups"].values()}
    g_idx = [k for k in load_file(str(out / "model.safetensors")) if k.endswith("weight_g_idx")]
    if static_groups is False:
        assert orders == {"group"} and len(g_idx) == 3 * 7
        return
    assert orders == {"weight"} and not g_idx
    assert _transformers_logits_cosine(out, llama_dir) > 0.9
