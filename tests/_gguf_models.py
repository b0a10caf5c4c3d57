"""GGUF test helpers: a tiny llama-architecture GGUF written with gguf-py, and llama.cpp's own quantizer
(``ggml_quantize_chunk`` of the ggml library llama-cpp-python ships, through ctypes) as the reference."""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path

import gguf
import numpy as np

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


def write_tiny_llama(path: Path, *, seed: int = 0, dtype: type = np.float32, n_layer: int = N_LAYER,
                     n_embd: int = N_EMBD, n_ff: int = N_FF, n_head_kv: int = N_HEAD_KV, lexicographic: bool = False
                     ) -> Path:
    """Write the model to ``path`` (2-D weights in ``dtype``, norms float32) and return ``path``.
    ``lexicographic``: the blocks in the order of their names as text (blk.0, blk.1, blk.10, blk.11, blk.2, …),
    as a converter that reads a checkpoint's sorted keys writes them."""
    rng = np.random.default_rng(seed)
    tokens, scores, types = vocab()
    n_vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama-test")
    w.add_context_length(512)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(n_embd // N_HEAD)
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
        return (1.0 + 0.1 * rng.standard_normal(n_embd)).astype(np.float32)

    head_dim = n_embd // N_HEAD
    w.add_tensor("token_embd.weight", mat(n_vocab, n_embd))
    for i in sorted(range(n_layer), key=str) if lexicographic else range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        w.add_tensor(f"blk.{i}.attn_q.weight", mat(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.attn_k.weight", mat(n_head_kv * head_dim, n_embd))
        w.add_tensor(f"blk.{i}.attn_v.weight", mat(n_head_kv * head_dim, n_embd))
        w.add_tensor(f"blk.{i}.attn_output.weight", mat(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(n_embd, n_ff))
    w.add_tensor("output_norm.weight", norm())
    w.add_tensor("output.weight", mat(n_vocab, n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@cache
def ggml_library() -> ctypes.CDLL | None:
    """The ggml base library of the installed llama-cpp-python, or None when it is not installed."""
    try:
        import llama_cpp
    except Exception:  # not installed, or its native library does not load here
        return None
    path = os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so")
    if not os.path.exists(path):
        return None
    lib = ctypes.CDLL(path)
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_void_p]
    return lib


def ggml_quantize(x: np.ndarray, type_id: int, row_bytes: int, importance: np.ndarray | None = None) -> np.ndarray:
    """``ggml_quantize_chunk`` over all rows of the 2-D float32 ``x``: ``[rows, row_bytes]`` uint8."""
    lib = ggml_library()
    if lib is None:
        raise RuntimeError("llama-cpp-python's ggml library is not available")
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((x.shape[0], row_bytes), dtype=np.uint8)
    imp = None if importance is None else np.ascontiguousarray(importance, dtype=np.float32)
    lib.ggml_quantize_chunk(type_id, x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1],
                            None if imp is None else imp.ctypes.data)
    return out


def llama_cpp_or_none() -> object | None:
    """The ``llama_cpp`` module when llama-cpp-python is installed and its native library loads."""
    try:
        import llama_cpp
    except Exception:  # not installed, or built for another machine
        return None
    return llama_cpp


PROMPT = b" the cat sat on the mat hello world"


def llama_logits(path: Path) -> np.ndarray:
    """llama.cpp's logits for every position of :data:`PROMPT` with the model at ``path`` (2 threads)."""
    llama_cpp = llama_cpp_or_none()
    assert llama_cpp is not None
    m = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=2,  # type: ignore[attr-defined]
                        n_threads_batch=2)
    try:
        tokens = m.tokenize(PROMPT)
        m.eval(tokens)
        return np.array(m.scores[:len(tokens)], dtype=np.float64)
    finally:
        m.close()


def llama_quantize(src: Path, dst: Path, ftype: int, *, nthread: int = 1) -> float:
    """llama.cpp's own ``llama_model_quantize`` (``llama-quantize``): seconds taken."""
    import ctypes
    import time

    llama_cpp = llama_cpp_or_none()
    assert llama_cpp is not None
    params = llama_cpp.llama_model_quantize_default_params()  # type: ignore[attr-defined]
    params.ftype = ftype
    params.nthread = nthread
    t0 = time.perf_counter()
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))  # type: ignore[attr-defined]
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed with {rc}")
    return time.perf_counter() - t0
