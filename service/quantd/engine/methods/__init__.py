"""Quantization methods behind one registry (CONTRACT §10): ``rtn``, ``hqq``, ``gptq``, ``awq``.

Each module registers one :class:`Method`; the wire schemas' ``MethodName`` literal, ``/v1/info``'s
``methods``/``method_args``, the CLI's ``--method`` and the docs' table all list this registry (a test pins
the literal to it).
"""

from __future__ import annotations

import torch

from quantd.engine.types import QuantizedTensor
from quantd.errors import ConfigError
from quantd_client import Scheme

from . import awq, gptq, hqq, rtn  # noqa: F401  (each registers itself)
from .base import METHODS, Arg, LayerHessian, Method, get_method, register


def check_method(shape: tuple[int, ...], scheme: Scheme, *, name: str, has_calibration: bool) -> Method:
    """ConfigError (naming ``name`` and the field) unless ``scheme``'s method can run on a tensor of
    ``shape``: its arguments, the schemes it supports, and calibration when it needs it."""
    method = get_method(scheme.method, tensor=name)
    args = method.resolve_args(scheme, tensor=name)
    method.check(tuple(shape), scheme, args, name)
    if method.needs == "hessian" and not has_calibration:
        raise ConfigError(f"method {method.name!r} needs calibration for this tensor: the job's calibration "
                          f"file has neither its input rows nor its Hessian (CONTRACT §10)", field="calibration",
                          tensor=name)
    return method


def quantize_tensor(x: torch.Tensor, scheme: Scheme, *, name: str = "tensor",
                    calibration: LayerHessian | None = None) -> QuantizedTensor:
    """Quantize ``x`` with ``scheme.method`` (checked as :func:`check_method` does)."""
    method = check_method(tuple(x.shape), scheme, name=name,
                          has_calibration=calibration is not None)
    args = method.resolve_args(scheme, tensor=name)
    return method.quantize(x, scheme, args, calibration if method.needs == "hessian" else None, name)


def output_rel_error(x: torch.Tensor, qt: QuantizedTensor, hessian: torch.Tensor) -> float | None:
    """``tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)`` (ΔW = Ŵ − W): the relative error of the layer's output over its
    calibration inputs; None when the weight is not a ``[out, in]`` matrix of ``H``'s width or ``W H Wᵀ``
    has no trace."""
    from quantd.engine.primitives import dequantize

    if x.dim() != 2 or x.shape[1] != hessian.shape[0]:
        return None
    w = x.float()
    h = hessian.float()
    dw = dequantize(qt) - w
    den = float(((w @ h) * w).sum(dtype=torch.float64))
    if den <= 0.0:
        return None
    return float(((dw @ h) * dw).sum(dtype=torch.float64)) / den


def artifact_extras(scheme: Scheme, *, name: str = "tensor") -> tuple[str, bool, bool]:
    """What the method's result adds to the artifact: the zero point domain (``int``/``float``), whether it
    carries ``g_idx`` and whether it carries ``channel_scale``."""
    method = get_method(scheme.method, tensor=name)
    args = method.resolve_args(scheme, tensor=name)
    return method.zero_point_domain(scheme, args), method.uses_g_idx(scheme, args), \
        method.uses_channel_scale(scheme, args)


__all__ = ["METHODS", "Arg", "LayerHessian", "Method", "artifact_extras", "check_method", "get_method",
           "output_rel_error", "quantize_tensor", "register"]
