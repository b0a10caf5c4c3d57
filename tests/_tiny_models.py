"""Tiny transformers models saved as model directories (``from_config`` + ``save_pretrained``, a word-level
tokenizer built with the ``tokenizers`` library) and calibration lines for them: nothing is downloaded."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

with warnings.catch_warnings():  # the model modules' import-time deprecation notices
    warnings.simplefilter("ignore", DeprecationWarning)
    import tokenizers
    import transformers
    from transformers import (
        AutoModel,
        AutoModelForCausalLM,
        BertConfig,
        BertModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

__all__ = ["LLAMA", "AutoModel", "AutoModelForCausalLM", "LlamaConfig", "LlamaForCausalLM", "id_rows", "save_tokenizer",
           "sentences", "tiny_bert", "tiny_llama", "write_jsonl"]

WORDS = ("the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "table", "quickly", "slowly", "red", "blue",
         "big", "small", "and", "then", "it", "was")
VOCAB = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
LLAMA = {"vocab_size": 48, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64,
         "tie_word_embeddings": False}
BERT = {"vocab_size": 48, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 64}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Norm weights and biases away from 1 and 0, so that a wrong fold shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5 if name.endswith("weight")
                        else torch.randn(p.shape, generator=g) * 0.1)


def save_tokenizer(path: Path) -> None:
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    fast.save_pretrained(str(path))


def tiny_llama(path: Path, *, seed: int = 0, tokenizer: bool = True, **overrides: Any) -> Path:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**LLAMA, **overrides}))
    _randomize(model, seed)
    model.save_pretrained(str(path))
    if tokenizer:
        save_tokenizer(path)
    return path


def tiny_bert(path: Path, *, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = BertModel(BertConfig(**BERT))
    _randomize(model, seed)
    model.save_pretrained(str(path))
    save_tokenizer(path)
    return path


def sentences(n: int, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (int(torch.randint(4, 14, (1,), generator=g)),),
                                                          generator=g)) for _ in range(n)]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def id_rows(n: int, vocab: int = 48, seed: int = 0) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(2, vocab, (int(torch.randint(3, 12, (1,), generator=g)),),
                                        generator=g).tolist()} for _ in range(n)]


