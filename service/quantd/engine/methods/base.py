"""The method protocol and registry: how a weight is turned into a :class:`QuantizedTensor`.

A method is one module that registers one :class:`Method` at import. It declares what it needs
(``"none"``; ``"hessian"``: the second moment ``H = Σ x xᵀ`` of the layer's inputs, CONTRACT §10), the
arguments it takes in ``scheme.method_args`` and which schemes it can run, and it returns a
``QuantizedTensor`` whose dequantization is the artifact's (a float zero point, a column order ``g_idx``
or per-input-channel ``channel_scale`` where the method produces them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from quantd.engine.types import QuantizedTensor
from quantd.errors import ConfigError
from quantd_client import Scheme

Needs = Literal["none", "hessian"]
ArgType = Literal["float", "int", "bool"]


@dataclass(frozen=True)
class Arg:
    """One entry of ``scheme.method_args``: its type, default, inclusive bounds and meaning."""

    name: str
    type: ArgType
    default: float | bool
    description: str
    min: float | None = None
    max: float | None = None

    def parse(self, value: float | bool, *, method: str, tensor: str) -> float | bool:
        where = f"scheme.method_args.{self.name}"
        if self.type == "bool":
            if not isinstance(value, bool):
                raise ConfigError(f"{method} takes true or false, got {value!r}", field=where, tensor=tensor)
            return value
        if isinstance(value, bool):
            raise ConfigError(f"{method} takes a number, got {value!r}", field=where, tensor=tensor)
        v = float(value)
        if not math.isfinite(v):
            raise ConfigError(f"{method} takes a finite number, got {value!r}", field=where, tensor=tensor)
        if self.type == "int" and not v.is_integer():
            raise ConfigError(f"{method} takes an integer, got {value!r}", field=where, tensor=tensor)
        if (self.min is not None and v < self.min) or (self.max is not None and v > self.max):
            raise ConfigError(f"{method} takes a value in [{self.min}, {self.max}], got {value!r}", field=where,
                              tensor=tensor)
        return int(v) if self.type == "int" else v


@dataclass(frozen=True)
class LayerHessian:
    """What a calibrated method knows of one Linear layer's inputs: ``H = Σ x xᵀ`` (float32 ``[in, in]``,
    on the device the method runs on) over ``count`` rows."""

    hessian: torch.Tensor
    count: int


QuantizeFn = Callable[[torch.Tensor, Scheme, Mapping[str, float | bool], LayerHessian | None, str], QuantizedTensor]
CheckFn = Callable[[tuple[int, ...], Scheme, Mapping[str, float | bool], str], None]


def _no_check(shape: tuple[int, ...], scheme: Scheme, args: Mapping[str, float | bool], name: str) -> None:
    return None


@dataclass(frozen=True)
class Method:
    """A registered method. ``quantize(x, scheme, args, calibration, name)`` gets ``args`` with every
    default filled in and ``calibration`` when ``needs == "hessian"``; ``check`` refuses (ConfigError) the
    schemes and shapes the method cannot run, before any work starts. ``zero_point_domain``,
    ``uses_g_idx`` and ``uses_channel_scale`` say which artifact tensors its result carries."""

    name: str
    needs: Needs
    description: str
    args: tuple[Arg, ...]
    quantize: QuantizeFn
    check: CheckFn = _no_check
    zero_point_domain: Callable[[Scheme, Mapping[str, float | bool]], str] = field(
        default=lambda scheme, args: "int")
    uses_g_idx: Callable[[Scheme, Mapping[str, float | bool]], bool] = field(default=lambda scheme, args: False)
    uses_channel_scale: Callable[[Scheme, Mapping[str, float | bool]], bool] = field(
        default=lambda scheme, args: False)

    def resolve_args(self, scheme: Scheme, *, tensor: str) -> dict[str, float | bool]:
        """``scheme.method_args`` checked against this method's arguments, defaults filled in."""
        known = {a.name: a for a in self.args}
        unknown = sorted(set(scheme.method_args) - set(known))
        if unknown:
            takes = ", ".join(sorted(known)) or "no arguments"
            raise ConfigError(f"{unknown} not understood by method {self.name!r} (it takes {takes})",
                              field="scheme.method_args", tensor=tensor)
        out: dict[str, float | bool] = {a.name: a.default for a in self.args}
        for k, v in scheme.method_args.items():
            out[k] = known[k].parse(v, method=self.name, tensor=tensor)
        return out


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add ``method`` to the registry under its name (one name, one method)."""
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is registered twice")
    METHODS[method.name] = method
    return method


def get_method(name: str, *, tensor: str = "tensor") -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise ConfigError(f"unknown method {name!r} (this server has {sorted(METHODS)})", field="scheme.method",
                          tensor=tensor) from None
