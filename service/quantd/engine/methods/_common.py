"""Helpers the methods share: which schemes a weight-matrix method can run, and the integer encode with
given scale and zero point."""

from __future__ import annotations

import torch

from quantd.engine.granularity import check_applicable, granularity_of
from quantd.errors import ConfigError
from quantd_client import Scheme
from quantd_client._dtypes import DTypeInfo, dtype_info


def check_integer_scheme(shape: tuple[int, ...], scheme: Scheme, method: str, name: str) -> DTypeInfo:
    """ConfigError unless ``scheme`` is an integer dtype at channel or group granularity that applies to
    ``shape``."""
    info = dtype_info(scheme.dtype)
    if info.kind != "int":
        raise ConfigError(f"method {method!r} quantizes to integer dtypes (int2…int8, uint4, uint8), not "
                          f"{scheme.dtype}", field="scheme.dtype", tensor=name)
    if scheme.granularity == "tensor":
        raise ConfigError(f"method {method!r} works per channel or per group", field="scheme.granularity",
                          tensor=name)
    check_applicable(shape, granularity_of(scheme), name=name)
    return info


def check_linear_weight(shape: tuple[int, ...], scheme: Scheme, method: str, name: str) -> DTypeInfo:
    """As :func:`check_integer_scheme`, for methods that see ``[out, in]`` Linear weights (axis 0)."""
    info = check_integer_scheme(shape, scheme, method, name)
    if len(shape) != 2:
        raise ConfigError(f"method {method!r} quantizes 2-D Linear weights [out, in], not shape {list(shape)}",
                          field="scheme.method", tensor=name)
    if scheme.axis % 2 != 0:
        raise ConfigError(f"method {method!r} keeps one scale per output row (axis 0), not axis {scheme.axis}",
                          field="scheme.axis", tensor=name)
    return info


def encode(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, info: DTypeInfo) -> torch.Tensor:
    """``clamp(round(w / scale) + zero_point, qmin, qmax)`` in float32 (the primitives' formula), broadcast."""
    q = torch.round(w / scale)
    if zero_point is not None:
        q = q + zero_point
    return q.clamp_(info.qmin, info.qmax)


def group_columns(cols: int, scheme: Scheme) -> int:
    """Columns that share one scale: the group size, or every column per channel."""
    return scheme.group_size if scheme.granularity == "group" else cols
