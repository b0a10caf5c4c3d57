"""An int8 Linear layer for static quantization: int8 weights and inputs, int32 accumulation.

Weights: per output channel, symmetric int8 (``choose_qparams``: ``s_w[o] = absmax / 127.5``, codes
in [−128, 127]). Input: per tensor, ``x_q = clamp(round(x / s_x) + zp_x, −128, 127)``. Bias: int32,
``b_q = round(b / (s_x · s_w))``, which must fit in what the products leave of int32: ``|b_q| ≤ 2³¹ − 1 −
K·255·128``. ``from_float`` sees to it by raising the scale of a row whose bias would not fit (a pruned
row's ``absmax`` of 0, or a tiny one, would give ``s_w`` near 0 and a bias code beyond int32) to
``|b| / (s_x · (2³¹ − 1 − K·255·128))``: its weights keep codes on that scale, each step ~5·10⁻¹⁰ of
``|b|``. The forward accumulates exactly in integers::

    acc[m, o] = Σ_k x_q[m, k] · w_q[o, k] − zp_x · Σ_k w_q[o, k] + b_q[o]      (int32)
    y = acc · s_x · s_w[o]                                                      (float, in float64)

and, with an ``output_scale``, requantizes ``y`` to int8 (``clamp(round(y / s_y) + zp_y, −128, 127)``).
The int8 × int8 → int32 product is ``torch._int_mm`` where the device and shapes allow it, else a
float64 matmul of the integer codes, which is exact while ``K·128² < 2⁵³``. int32 accumulation is
exact while ``K·255·128 < 2³¹`` (K up to 65 793 inputs); larger layers are refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quantd.engine.primitives import quantize
from quantd.errors import ConfigError, MalformedInputError
from quantd_client import Scheme

__all__ = ["QuantizedLinear", "int8_matmul"]

INT8_MIN, INT8_MAX = -128, 127
MAX_IN_FEATURES = (2**31 - 1) // (255 * 128)


def bias_headroom(in_features: int) -> int:
    """The largest ``|b_q|`` that int32 holds beside the products of ``in_features`` inputs
    (``|Σ (x_q − zp_x)·w_q| ≤ K·255·128``)."""
    return 2**31 - 1 - in_features * 255 * 128


def _int_mm_supported(m: int, k: int, n: int, device: torch.device) -> bool:
    if device.type == "cpu":
        return True
    if device.type == "cuda":  # cuBLASLt int8 GEMM constraints
        return m > 16 and k >= 16 and k % 8 == 0 and n % 8 == 0
    return False


def int8_matmul(a: torch.Tensor, b_t: torch.Tensor, *, use_int_mm: bool = True) -> torch.Tensor:
    """Exact ``a @ b_t.T`` → int32 for int8 ``a[M, K]`` and ``b_t[N, K]``."""
    m, k = a.shape
    n = b_t.shape[0]
    if use_int_mm and _int_mm_supported(m, k, n, a.device):
        return torch._int_mm(a.contiguous(), b_t.t())
    return (a.double() @ b_t.double().t()).to(torch.int32)


def _check_bias(bias_codes: torch.Tensor, weight_shape: tuple[int, ...]) -> None:
    if bias_codes.dtype != torch.int32 or tuple(bias_codes.shape) != (weight_shape[0],):
        raise MalformedInputError(f"bias codes must be an int32 vector of {weight_shape[0]}, got {bias_codes.dtype} "
                                  f"{tuple(bias_codes.shape)}", tensor="bias")
    headroom = bias_headroom(weight_shape[1])
    if bias_codes.numel() and int(bias_codes.abs().max()) > headroom:
        raise ConfigError(f"a bias code beyond ±{headroom} could overflow the int32 accumulator with "
                          f"{weight_shape[1]} input features (from_float raises such rows' scales)",
                          tensor="bias", field="bias_codes")


class QuantizedLinear(nn.Module):
    """``y = x Wᵀ + b`` with int8 weights/inputs and int32 accumulation (see the module docstring)."""

    weight_codes: torch.Tensor
    weight_scale: torch.Tensor
    weight_row_sums: torch.Tensor
    bias_codes: torch.Tensor | None

    def __init__(self, weight_codes: torch.Tensor, weight_scale: torch.Tensor, bias_codes: torch.Tensor | None,
                 *, input_scale: float, input_zero_point: int = 0, output_scale: float | None = None,
                 output_zero_point: int = 0) -> None:
        super().__init__()
        if weight_codes.dtype != torch.int8 or weight_codes.dim() != 2:
            raise MalformedInputError(f"weight codes must be a 2-D int8 tensor, got {weight_codes.dtype} "
                                      f"{tuple(weight_codes.shape)}", tensor="weight")
        if weight_codes.shape[1] > MAX_IN_FEATURES:
            raise ConfigError(f"{weight_codes.shape[1]} input features could overflow the int32 accumulator "
                              f"(at most {MAX_IN_FEATURES})", tensor="weight", field="in_features")
        if not input_scale > 0 or (output_scale is not None and not output_scale > 0):
            raise ConfigError("scales must be positive", tensor="input", field="input_scale")
        if not INT8_MIN <= input_zero_point <= INT8_MAX or not INT8_MIN <= output_zero_point <= INT8_MAX:
            raise ConfigError("zero points must be int8", tensor="input", field="input_zero_point")
        if bias_codes is not None:
            _check_bias(bias_codes, weight_codes.shape)
        self.out_features, self.in_features = weight_codes.shape
        self.register_buffer("weight_codes", weight_codes)
        self.register_buffer("weight_scale", weight_scale.float())
        self.register_buffer("weight_row_sums", weight_codes.to(torch.int32).sum(1, dtype=torch.int32))
        self.register_buffer("bias_codes", bias_codes)
        self.input_scale = float(input_scale)
        self.input_zero_point = int(input_zero_point)
        self.output_scale = None if output_scale is None else float(output_scale)
        self.output_zero_point = int(output_zero_point)

    @classmethod
    def from_float(cls, linear: nn.Linear, *, input_scale: float, input_zero_point: int = 0,
                   output_scale: float | None = None, output_zero_point: int = 0,
                   scale_dtype: str = "float32") -> QuantizedLinear:
        """Quantize a float ``nn.Linear`` (weights per channel, bias to int32 at ``s_x · s_w``)."""
        w = linear.weight.detach()
        if not input_scale > 0:
            raise ConfigError("scales must be positive", tensor="input", field="input_scale")
        scheme = Scheme.model_validate({"dtype": "int8", "symmetric": True, "granularity": "channel",
                                        "axis": 0, "scale_dtype": scale_dtype})
        bias = None if linear.bias is None else linear.bias.detach().double()
        headroom = bias_headroom(w.shape[1])
        observed = None
        if bias is not None:  # each row's range at least what makes its bias code fit (module docstring)
            absmax = w.abs().amax(dim=1).double() if w.numel() else torch.zeros(w.shape[0], dtype=torch.float64)
            floor = bias.abs() / (input_scale * headroom) * ((INT8_MAX - INT8_MIN) / 2) * (1 + 2**-20)
            absmax = torch.maximum(absmax, floor)  # 2⁻²⁰ up: still above the floor once rounded to float32
            observed = (-absmax, absmax)
        qt = quantize(w, scheme, name="weight", observer_range=observed)
        if qt.scale is None:
            raise ConfigError("int8 weights need a scale", tensor="weight", field="scale")
        w_scale = qt.scale.float()
        bias_codes = None
        if bias is not None:
            b = torch.round(bias / (input_scale * w_scale.double()))
            bias_codes = b.clamp(-headroom, headroom).to(torch.int32)  # a no-op: the scales made room
        return cls(qt.codes.to(torch.int8), w_scale, bias_codes, input_scale=input_scale,
                   input_zero_point=input_zero_point, output_scale=output_scale,
                   output_zero_point=output_zero_point)

    def get_extra_state(self) -> dict[str, float | int | None]:
        """The input and output quantization, saved in ``state_dict()`` beside the buffers."""
        return {"input_scale": self.input_scale, "input_zero_point": self.input_zero_point,
                "output_scale": self.output_scale, "output_zero_point": self.output_zero_point}

    def set_extra_state(self, state: dict[str, float | int | None]) -> None:
        self.input_scale = float(state["input_scale"])  # type: ignore[arg-type]
        self.input_zero_point = int(state["input_zero_point"])  # type: ignore[arg-type]
        out = state["output_scale"]
        self.output_scale = None if out is None else float(out)
        self.output_zero_point = int(state["output_zero_point"])  # type: ignore[arg-type]

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # A layer with a bias loads into one made without (and the reverse): the buffer follows the checkpoint.
        # A whole layer's state (its weight codes) decides; a partial one (strict=False) keeps the bias.
        bias = state_dict.get(prefix + "bias_codes")
        if bias is not None:
            _check_bias(bias, tuple(state_dict.get(prefix + "weight_codes", self.weight_codes).shape))
        if bias is not None or prefix + "weight_codes" in state_dict:
            self.bias_codes = None if bias is None else torch.empty_like(bias, device=self.weight_codes.device)
        # A state dict without the input/output quantization keeps this layer's.
        state_dict.setdefault(prefix + "_extra_state", self.get_extra_state())
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """``clamp(round(x / s_x) + zp_x, −128, 127)`` as int8."""
        q = torch.round(x.float() / self.input_scale) + self.input_zero_point
        return q.clamp_(INT8_MIN, INT8_MAX).to(torch.int8)

    def accumulate(self, x_q: torch.Tensor, *, use_int_mm: bool = True) -> torch.Tensor:
        """The int32 accumulator ``[M, out]`` for int8 inputs ``x_q[M, in]``."""
        acc = int8_matmul(x_q, self.weight_codes, use_int_mm=use_int_mm)
        if self.input_zero_point:
            acc = acc - self.input_zero_point * self.weight_row_sums
        if self.bias_codes is not None:
            acc = acc + self.bias_codes
        return acc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise MalformedInputError(f"input has {x.shape[-1]} features, the layer takes {self.in_features}",
                                      tensor="input")
        lead = x.shape[:-1]
        acc = self.accumulate(self.quantize_input(x.reshape(-1, self.in_features)))
        y = acc.double() * (self.input_scale * self.weight_scale.double())
        if self.output_scale is None:
            return y.to(x.dtype if x.is_floating_point() else torch.float32).reshape(*lead, self.out_features)
        q = torch.round(y / self.output_scale) + self.output_zero_point
        return q.clamp_(INT8_MIN, INT8_MAX).to(torch.int8).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"input_scale={self.input_scale}, input_zero_point={self.input_zero_point}, "
                f"output_scale={self.output_scale}")
