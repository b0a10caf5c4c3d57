"""The table of quantization dtypes: every bound and bit width comes from here.

Shared by the engine (torch) and the NumPy dequantizer, so the two can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DTypeKind = Literal["int", "nf4", "fp8", "float", "ggml"]


@dataclass(frozen=True)
class DTypeInfo:
    """One target dtype.

    ``qmin``/``qmax`` are the code domain of integer dtypes (``int4``: −8…7, ``uint4``: 0…15);
    for nf4 they are the codebook indices 0…15. ``storage`` is the safetensors dtype of
    ``N.qdata`` in the artifact; ``packed`` dtypes store ``bits``-wide offsets ``code − qmin``
    as a little-endian bitstream in ``uint8``.
    """

    name: str
    kind: DTypeKind
    bits: int
    qmin: int
    qmax: int
    storage: str  # safetensors dtype string of N.qdata: I8, U8, F8_E4M3, F8_E5M2, F16, BF16
    max_finite: float = 0.0  # fp8 / float: the largest finite value

    @property
    def signed(self) -> bool:
        return self.qmin < 0

    @property
    def packed(self) -> bool:
        return self.bits < 8

    @property
    def levels(self) -> int:
        return self.qmax - self.qmin + 1


DTYPES: dict[str, DTypeInfo] = {
    d.name: d
    for d in (
        DTypeInfo("int8", "int", 8, -128, 127, "I8"),
        DTypeInfo("int4", "int", 4, -8, 7, "U8"),
        DTypeInfo("int3", "int", 3, -4, 3, "U8"),
        DTypeInfo("int2", "int", 2, -2, 1, "U8"),
        DTypeInfo("uint8", "int", 8, 0, 255, "U8"),
        DTypeInfo("uint4", "int", 4, 0, 15, "U8"),
        DTypeInfo("nf4", "nf4", 4, 0, 15, "U8"),
        DTypeInfo("fp8_e4m3", "fp8", 8, 0, 0, "F8_E4M3", 448.0),
        DTypeInfo("fp8_e5m2", "fp8", 8, 0, 0, "F8_E5M2", 57344.0),
        DTypeInfo("float16", "float", 16, 0, 0, "F16", 65504.0),
        DTypeInfo("bfloat16", "float", 16, 0, 0, "BF16", 3.3895313892515355e38),
    )
}

# ggml's block types (llama.cpp's GGUF files; only with ``output: "gguf"``): their layout is ggml's own,
# ``bits`` is the nominal code width (the scales add to it: q4_k stores 4.5 bits per weight).
GGML_DTYPES: tuple[str, ...] = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
DTYPES.update({name: DTypeInfo(name, "ggml", int(name[1]), 0, 0, "U8") for name in GGML_DTYPES})

# llama.cpp's named mixes (``llama-quantize``'s file types) that ``gguf_mix`` accepts.
GGUF_MIXES: tuple[str, ...] = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",
                               "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")

# The 16-level NormalFloat codebook of QLoRA (Dettmers et al. 2023), values in [−1, 1].
NF4_CODEBOOK: tuple[float, ...] = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)

SCALE_DTYPES = ("float16", "bfloat16", "float32")
OBSERVERS = ("minmax", "percentile", "meanstd", "ema", "mse", "entropy")
METHODS = ("rtn", "hqq", "gptq", "awq")
GRANULARITIES = ("tensor", "channel", "group")
INPUT_FORMATS = ("safetensors", "pytorch", "npy", "npz", "gguf")
OUTPUT_FORMATS = ("safetensors", "compressed-tensors", "gguf")
# The formats whose output is a model directory even from one weight file (they write config.json).
DIRECTORY_OUTPUT_FORMATS = ("compressed-tensors",)


def dtype_info(name: str) -> DTypeInfo:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None
