"""A tiny llama-architecture GGUF written with gguf-py's ``GGUFWriter``: random weights whose rows are
whole k-quant super-blocks (256), and a small SentencePiece-style vocabulary (control tokens, the 256
byte-fallback tokens and a few pieces) so that llama.cpp can load and run it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import gguf

N_EMBD = 256
N_FF = 512
N_HEAD = 4
N_HEAD_KV = 1  # grouped-query attention, as in current llama models (n_gqa 4)
N_LAYER = 4
PIECES = ["▁", "▁the", "▁a", "▁cat", "▁dog", "▁sat", "▁on", "▁mat", "e", "t", "a", "o", "s", "n", "▁hello",
          "▁world", "he", "llo", "wor", "ld"]


def vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(PIECES))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(PIECES)
    return tokens, scores, types


def write_tiny_llama(path: Path, *, seed: int = 0, dtype: type = np.float32) -> Path:
    """Write the model to ``path`` (2-D weights in ``dtype``, norms float32) and return ``path``."""
    rng = np.random.default_rng(seed)
    tokens, scores, types = vocab()
    n_vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama-test")
    w.add_context_length(128)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(dtype)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(N_EMBD)).astype(np.float32)

    head_dim = N_EMBD // N_HEAD
    w.add_tensor("token_embd.weight", mat(n_vocab, N_EMBD))
    for i in range(N_LAYER):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        w.add_tensor(f"blk.{i}.attn_q.weight", mat(N_EMBD, N_EMBD))
        w.add_tensor(f"blk.{i}.attn_k.weight", mat(N_HEAD_KV * head_dim, N_EMBD))
        w.add_tensor(f"blk.{i}.attn_v.weight", mat(N_HEAD_KV * head_dim, N_EMBD))
        w.add_tensor(f"blk.{i}.attn_output.weight", mat(N_EMBD, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(N_FF, N_EMBD))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(N_EMBD, N_FF))
    w.add_tensor("output_norm.weight", norm())
    w.add_tensor("output.weight", mat(n_vocab, N_EMBD))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
