"""The schemes that CPU/GPU parity is checked on (tests/engine/test_cuda.py on a GPU, and on any machine the
arithmetic rule behind it, tests/engine/test_device_arithmetic.py): every kind of dtype, granularity, scale
dtype and range observer."""

from __future__ import annotations

from typing import Any

DEVICE_SCHEMES: list[dict[str, Any]] = [
    {"dtype": "int8", "granularity": "channel", "symmetric": True},
    {"dtype": "int4", "granularity": "group", "group_size": 128},
    {"dtype": "int4", "granularity": "group", "group_size": 64, "symmetric": True},
    {"dtype": "int3", "granularity": "channel", "axis": 1},
    {"dtype": "uint4", "granularity": "tensor"},
    {"dtype": "int2", "granularity": "group", "group_size": 32, "scale_dtype": "float32"},
    {"dtype": "nf4", "granularity": "group", "group_size": 64},
    {"dtype": "fp8_e4m3", "granularity": "channel"},
    {"dtype": "fp8_e5m2", "granularity": "tensor"},
    {"dtype": "fp8_e5m2", "granularity": "tensor", "scale_dtype": "bfloat16"},
    {"dtype": "bfloat16"},
    {"dtype": "int8", "granularity": "channel", "observer": "mse"},
    {"dtype": "int4", "granularity": "group", "group_size": 128, "observer": "mse"},
    {"dtype": "nf4", "granularity": "group", "group_size": 64, "observer": "mse"},
    {"dtype": "fp8_e4m3", "granularity": "channel", "observer": "mse"},
    {"dtype": "int4", "granularity": "group", "group_size": 128, "observer": "percentile"},
    {"dtype": "int4", "granularity": "channel", "observer": "entropy"},
    {"dtype": "int8", "granularity": "group", "group_size": 128, "symmetric": True, "observer": "entropy"},
]
