"""Quantization-aware training: fake quantization with straight-through gradients, and LSQ.

Forward (all three): ``x̂ = (clamp(round(x / s) + zp, qmin, qmax) − zp) · s``, ``s``/``zp`` broadcast
against ``x`` (per tensor: scalars; per channel: size ``C`` on the channel axis, 1 elsewhere).

- :class:`FakeQuantizeSTE`: ``∂x̂/∂x = 1`` everywhere (straight-through estimator).
- :class:`FakeQuantizeClamped`: ``∂x̂/∂x = 1`` inside the representable range
  ``[(qmin − zp)·s, (qmax − zp)·s]``, 0 outside (judged on ``x/s + zp`` before rounding).
- :class:`LSQ` (Esser et al. 2019, "Learned Step Size Quantization"): gradients for ``x`` as the
  clamped STE, and for the scale, with ``u = x / s``::

      ∂x̂/∂s = round(u) − u     inside
              qmin − zp        below the range
              qmax − zp        above the range

  summed to the scale's shape and multiplied by ``grad_scale`` (LSQ's ``g = 1/√(N·Qp)``).

:class:`FakeQuantize` is the ``nn.Module``: while observing, each forward updates a streaming
:class:`~quantd.engine.observers.ActivationObserver` and sets ``scale``/``zero_point`` from it
(``choose_qparams``); :meth:`FakeQuantize.freeze` fixes them. ``learnable=True`` makes the scale an
``nn.Parameter`` trained by LSQ (the zero point stays fixed). The module computes in float32 (float64
inputs in float64) and returns its input's dtype; its ``state_dict`` holds scale, zero point and whether
it still observes (the observer's running statistics are not saved: a loaded module that still observes
starts them afresh).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from quantd.engine.observers import ActivationObserver
from quantd.errors import ConfigError
from quantd_client import Scheme
from quantd_client._dtypes import dtype_info

__all__ = ["LSQ", "FakeQuantize", "FakeQuantizeClamped", "FakeQuantizeSTE", "fake_quant"]


def fake_quant(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int
               ) -> torch.Tensor:
    """``(clamp(round(x / scale) + zero_point, qmin, qmax) − zero_point) · scale`` (no autograd rules)."""
    return (torch.clamp(torch.round(x / scale) + zero_point, qmin, qmax) - zero_point) * scale


def _sum_to(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum ``t`` over the dimensions that ``shape`` broadcasts (the reverse of broadcasting)."""
    lead = t.dim() - len(shape)
    dims = list(range(lead)) + [lead + i for i, n in enumerate(shape) if n == 1 and t.shape[lead + i] != 1]
    return t.sum(dim=dims, keepdim=True).reshape(shape) if dims else t.reshape(shape)


class FakeQuantizeSTE(torch.autograd.Function):
    """Fake quantization whose gradient w.r.t. ``x`` is the identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                qmin: int, qmax: int) -> torch.Tensor:
        return fake_quant(x, scale, zero_point, qmin, qmax)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grads[0], None, None, None, None


def _inside(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masks of the elements below / above the representable range ``[(qmin − zp)·s, (qmax − zp)·s]``
    (by the unrounded ``u + zp``, as LSQ's ``−Qn ≤ v/s ≤ Qp``: the half step beyond each end, which
    rounds onto it, counts as outside), and the unrounded codes ``u = x / s``."""
    u = x / scale
    t = u + zero_point
    return t < qmin, t > qmax, u


class FakeQuantizeClamped(torch.autograd.Function):
    """Fake quantization whose gradient w.r.t. ``x`` is 1 where nothing was clamped, else 0."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                qmin: int, qmax: int) -> torch.Tensor:
        low, high, _ = _inside(x, scale, zero_point, qmin, qmax)
        ctx.save_for_backward(~(low | high))
        return fake_quant(x, scale, zero_point, qmin, qmax)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (inside,) = ctx.saved_tensors
        return grads[0] * inside, None, None, None, None


class LSQ(torch.autograd.Function):
    """Fake quantization with a learnable step size (gradients in the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                qmin: int, qmax: int, grad_scale: float) -> torch.Tensor:
        ctx.save_for_backward(x, scale, zero_point)
        ctx.qrange = (qmin, qmax, grad_scale)
        return fake_quant(x, scale, zero_point, qmin, qmax)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, scale, zero_point = ctx.saved_tensors
        qmin, qmax, grad_scale = ctx.qrange
        g = grads[0]
        low, high, u = _inside(x, scale, zero_point, qmin, qmax)
        inside = ~(low | high)
        dxds = torch.where(low, qmin - zero_point, torch.where(high, qmax - zero_point, torch.round(u) - u))
        grad_scale_t = _sum_to(g * dxds, scale.shape) * grad_scale
        return g * inside, grad_scale_t, None, None, None, None


class FakeQuantize(nn.Module):
    """Observe → freeze fake quantization of a tensor, per tensor or per channel (integer dtypes).

    ``scheme.granularity`` ``tensor`` or ``channel`` (on ``axis``, default ``scheme.axis``: 0 = output
    rows of a weight; −1 = features of an activation). ``learnable=True``: the scale is an
    ``nn.Parameter`` trained with :class:`LSQ` (grad scale ``1/√(n·qmax)``, n = elements per scale);
    otherwise the gradient is the straight-through :class:`FakeQuantizeSTE`.
    """

    scale: torch.Tensor
    zero_point: torch.Tensor
    initialised: torch.Tensor

    def __init__(self, scheme: Scheme, *, learnable: bool = False, axis: int | None = None,
                 name: str = "fake_quantize") -> None:
        super().__init__()
        info = dtype_info(scheme.dtype)
        if info.kind != "int":
            raise ConfigError(f"fake quantization for training supports integer dtypes, not {scheme.dtype}",
                              tensor=name, field="dtype")
        self.observer = ActivationObserver(scheme, name=name, axis=axis)
        self.qmin, self.qmax = info.qmin, info.qmax
        self.learnable = learnable
        self.observing = True
        self.name = name
        if learnable:
            self.scale = nn.Parameter(torch.ones(()))
        else:
            self.register_buffer("scale", torch.ones(()))
        self.register_buffer("zero_point", torch.zeros(()))
        self.register_buffer("initialised", torch.zeros((), dtype=torch.bool))

    def enable_observer(self, enabled: bool = True) -> None:
        self.observing = enabled

    def freeze(self) -> None:
        """Stop observing: scale and zero point stay as they are (a learnable scale still trains)."""
        self.observing = False

    def _observe(self, x: torch.Tensor) -> None:
        self.observer.update(x.detach())
        scale, zp = self.observer.qparams()
        with torch.no_grad():
            self.scale.data = scale.to(device=x.device, dtype=torch.float32)
            self.zero_point = (torch.zeros_like(self.scale) if zp is None
                               else zp.to(device=x.device, dtype=torch.float32))
            self.initialised = torch.ones((), dtype=torch.bool, device=x.device)

    def _broadcast(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t
        shape = [1] * x.dim()
        shape[self.observer.axis % x.dim()] = t.numel()
        return t.reshape(shape)

    def get_extra_state(self) -> dict[str, bool]:
        return {"observing": self.observing}

    def set_extra_state(self, state: dict[str, bool]) -> None:
        self.observing = bool(state["observing"])

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # A per-channel module's scale and zero point have one value per channel, which a fresh one (0-d
        # until it observes) does not know yet: they take the checkpoint's shapes.
        for name in ("scale", "zero_point"):
            saved = state_dict.get(prefix + name)
            if isinstance(saved, torch.Tensor) and saved.shape != getattr(self, name).shape:
                getattr(self, name).data = torch.empty_like(saved, device=getattr(self, name).device)
        state_dict.setdefault(prefix + "_extra_state", self.get_extra_state())  # a state dict without it keeps this layer's
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:  # nothing to observe or quantize (an empty batch passes through)
            return x.clone()
        if self.observing:
            self._observe(x)
        if not bool(self.initialised):
            raise ConfigError("frozen before observing any input: no scale to quantize with",
                              tensor=self.name, field="scale")
        # float32 (float64 inputs: float64) whatever the input: x / s rounded in float16 or bfloat16 gave
        # other codes, and errors beyond s/2; per channel, a half input came back float32.
        xw = x if x.dtype == torch.float64 else x.float()
        scale = self._broadcast(self.scale.clamp(min=torch.finfo(torch.float32).tiny), xw).to(xw.dtype)
        zp = self._broadcast(self.zero_point, xw).to(xw.dtype)
        if self.learnable:
            grad_scale = 1.0 / math.sqrt(max(x.numel() // max(self.scale.numel(), 1), 1) * self.qmax)
            out: torch.Tensor = LSQ.apply(xw, scale, zp, self.qmin, self.qmax, grad_scale)  # type: ignore[no-untyped-call]
        else:
            out = FakeQuantizeSTE.apply(xw, scale, zp, self.qmin, self.qmax)  # type: ignore[no-untyped-call]
        return out.to(x.dtype)
