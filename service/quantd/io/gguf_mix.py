"""llama.cpp's named quantization mixes: which ggml type each tensor of a GGUF model gets.

A port of ``llama-quant.cpp``'s ``tensor_allows_quantization``, ``llama_tensor_get_type_impl`` (for the
k-quant and legacy mixes) and ``tensor_type_fallback``: the token embedding and output choices (``output``
— or a tied ``token_embd`` — to q6_k, or q8_0 when its rows are not whole super-blocks), ``attn_v`` and
``ffn_down`` raised to more bits in the first and last eighth of the layers and every third layer between
(``use_more_bits``), the mixture's own ``attn_output``/``attn_qkv`` choices, the 8-expert and grouped-query
cases, and the fallbacks when a row is not a multiple of a k-quant's 256 (q4_k → q5_0, q5_k → q5_1,
q6_k → q8_0, q2_k/q3_k → q4_0; float16 when even 32 does not divide it).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

# llama_ftype: the value of general.file_type for each mix, and its default ggml type.
FILE_TYPES: dict[str, int] = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_S": 11,
                              "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17,
                              "Q6_K": 18}
DEFAULT_TYPE: dict[str, str] = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0", "Q5_0": "q5_0", "Q5_1": "q5_1",
                                "Q2_K": "q2_k", "Q3_K_S": "q3_k", "Q3_K_M": "q3_k", "Q3_K_L": "q3_k",
                                "Q4_K_S": "q4_k", "Q4_K_M": "q4_k", "Q5_K_S": "q5_k", "Q5_K_M": "q5_k",
                                "Q6_K": "q6_k"}
BLOCK: dict[str, int] = {"q4_0": 32, "q4_1": 32, "q5_0": 32, "q5_1": 32, "q8_0": 32, "q2_k": 256, "q3_k": 256,
                         "q4_k": 256, "q5_k": 256, "q6_k": 256}
_FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}

# Substrings of names llama.cpp never quantizes (besides 1-D tensors, norms and non-"weight" tensors).
_KEEP = ("ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj", "ssm_conv1d",
         "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight", "time_mix_first.weight",
         "time_mix_w0.weight", "time_mix_w1.weight", "time_mix_w2.weight", "time_mix_v0.weight",
         "time_mix_v1.weight", "time_mix_v2.weight", "time_mix_a0.weight", "time_mix_a1.weight",
         "time_mix_a2.weight", "time_mix_g1.weight", "time_mix_g2.weight", "time_mix_decay_w1.weight",
         "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight", "attn_rel_b.weight", ".position_embd",
         "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook",
         "mm.a.code_embd")


def allows_quantization(name: str, n_dims: int) -> bool:
    """``tensor_allows_quantization``: 2-D and larger ``*weight`` tensors that are not norms, routers,
    position/type embeddings or the small special tensors llama.cpp keeps."""
    if n_dims < 2 or not name.endswith("weight") or "_norm.weight" in name:
        return False
    if name in ("position_embd.weight", "token_types.weight"):
        return False
    return not any(s in name for s in _KEEP)


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for key, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"), ("attn_v.weight", "attn_v"),
                     ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
                     ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if key in name:
            return cat
    return "other"


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def fallback(type_name: str, row: int) -> str:
    """``tensor_type_fallback``: a type whose block divides ``row``."""
    if row % BLOCK[type_name] == 0:
        return type_name
    alt = _FALLBACK.get(type_name, type_name)
    return alt if row % BLOCK[alt] == 0 else "float16"


@dataclass(frozen=True)
class ModelParams:
    """What the mixes ask of the model: ``general.architecture`` and its hyper-parameters."""

    arch: str
    n_layer: int
    n_head: int
    n_head_kv: int
    n_expert: int

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head_kv else 0

    @property
    def is_70b(self) -> bool:
        """llama.cpp's ``LLM_TYPE_70B``, which raises ``attn_v``: decided from the layer count (80), not the
        parameters, for llama (grouped-query, not 8 experts), qwen2, deci and olmo."""
        if self.n_layer != 80:
            return False
        if self.arch == "llama":
            return self.n_expert != 8 and self.n_head != self.n_head_kv
        return self.arch in ("qwen2", "deci", "olmo")


def ggml_n_dims(shape: Sequence[int]) -> int:
    """``ggml_n_dims``: the dims up to the last of more than one element in ggml's order (the torch shape
    reversed), at least 1. A ``[1, n]`` tensor is 1-D to llama.cpp, and stays float."""
    dims = len(shape)
    while dims > 1 and shape[len(shape) - dims] == 1:
        dims -= 1
    return max(dims, 1)


# ``sscanf(name, "blk.%d.", &layer)``: leading blanks, a sign, ASCII digits; the dot after them is not needed.
_BLK = re.compile(r"blk\.[ \t\n\v\f\r]*([+-]?[0-9]{1,18})", re.ASCII)  # 18 digits: an int64 at most


def weights_order(name: str) -> tuple[int, bytes]:
    """llama.cpp's ``weight_name_comparer``: the ``blk.N.`` layer number (−1 without one), then the name. The
    mixes count ``attn_v`` and ``ffn_down`` tensors in this order, whatever the file's order."""
    m = _BLK.match(name)
    return (int(m.group(1)) if m else -1), name.encode()


def _layer(name: str, counter: int, p: ModelParams) -> int:
    if p.n_expert > 1 and name.startswith("blk."):
        try:
            return int(name.split(".")[1])
        except ValueError:
            return counter
    return counter


def mix_types(mix: str, tensors: Sequence[tuple[str, tuple[int, ...]]], p: ModelParams, *,
              has_imatrix: bool = False) -> dict[str, str]:
    """The ggml type of every tensor (name, torch shape) that ``mix`` quantizes, in file order; tensors it
    keeps as they are are absent. The choices are made in llama.cpp's order (:func:`weights_order`), which is
    where the ``attn_v`` and ``ffn_down`` counters matter. ``has_imatrix``: the job has an importance matrix
    (llama.cpp then raises Q4_0's and Q5_0's first eighth of ``ffn_down`` layers to Q4_1/Q5_1)."""
    default = DEFAULT_TYPE[mix]
    names = [n for n, _ in tensors]
    tied = "output.weight" not in names
    n_attn_v = sum(1 for n in names if _category(n) in ("attn_v", "attn_qkv", "attn_kv_b"))
    i_v = i_down = 0
    n_layer = p.n_layer
    falcon = p.arch == "falcon"
    chosen: dict[str, str] = {}
    for name, shape in sorted(tensors, key=lambda t: weights_order(t[0])):
        if not allows_quantization(name, ggml_n_dims(shape)):
            continue
        cat = _category(name)
        t = default
        row = shape[-1]
        if cat == "output" or (tied and cat == "token_embd"):
            if falcon or row % 256:
                t = "q8_0"
            elif t != "q8_0":
                t = "q6_k"
        elif cat == "token_embd":
            pass
        elif cat in ("attn_v", "attn_qkv", "attn_kv_b"):
            if mix == "Q2_K":
                t = "q4_k" if p.n_gqa >= 4 else "q3_k"
            elif mix == "Q3_K_M":
                t = "q5_k" if i_v < 2 else "q4_k"
            elif mix == "Q3_K_L":
                t = "q5_k"
            elif mix in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i_v, n_attn_v):
                t = "q6_k"
            elif mix == "Q4_K_S" and i_v < 4:
                t = "q5_k"
            if p.is_70b and t in ("q3_k", "q4_k"):
                t = "q5_k"
            if p.n_expert == 8:
                t = "q8_0"
            i_v += 1  # attn_qkv/attn_kv_b count as attn_v (llama.cpp's own attn_qkv branch is unreachable)
        elif cat == "attn_k":
            if p.n_expert == 8:
                t = "q8_0"
        elif cat == "ffn_down":
            i = _layer(name, i_down, p)
            if mix == "Q2_K":
                t = "q3_k"
            elif mix == "Q3_K_M":
                t = "q5_k" if i < n_layer // 16 else "q4_k" if not falcon or _use_more_bits(i, n_layer) else "q3_k"
            elif mix == "Q3_K_L":
                t = "q4_k" if falcon else "q5_k"
            elif mix == "Q4_K_M":
                if falcon:
                    t = "q6_k" if i < n_layer // 16 else "q5_k" if _use_more_bits(i, n_layer) else "q4_k"
                elif _use_more_bits(i, n_layer):
                    t = "q6_k"
            elif mix == "Q5_K_M" and _use_more_bits(i, n_layer):
                t = "q6_k"
            elif mix == "Q4_K_S" and not falcon and i < n_layer // 8:
                t = "q5_k"
            elif mix in ("Q4_0", "Q5_0") and has_imatrix and i < n_layer // 8:
                t = "q4_1" if mix == "Q4_0" else "q5_1"  # llama.cpp: "guard against craziness" in early ffn_down
            i_down += 1
        elif cat == "attn_output":
            if not falcon:
                if p.n_expert == 8:
                    if mix in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M"):
                        t = "q5_k"
                elif mix == "Q2_K":
                    t = "q3_k"
                elif mix == "Q3_K_M":
                    t = "q4_k"
                elif mix == "Q3_K_L":
                    t = "q5_k"
            elif mix == "Q3_K_L":
                t = "q4_k"
        chosen[name] = fallback(t, row)
    return {name: chosen[name] for name in names if name in chosen}
