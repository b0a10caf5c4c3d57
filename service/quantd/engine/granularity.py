"""Granularity: which elements share one scale, turned once into a 2-D block view.

Every granularity maps a tensor ``x`` to blocks ``[B, K]`` (one scale per block row):

- tensor: ``x.reshape(1, -1)``; scale shape ``[]``
- channel(axis): ``V = x.movedim(axis, 0).reshape(shape[axis], -1)``; scale ``[shape[axis]]``
- group(group_size, axis): ``V`` as for channel (1-D/0-d tensors: ``x.reshape(1, -1)``), then
  ``V.reshape(-1, group_size)``; scale ``[V.shape[0], V.shape[1] // group_size]``
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from quantd.errors import ConfigError
from quantd_client import Scheme


@dataclass(frozen=True)
class PerTensor:
    """One scale for the whole tensor."""


@dataclass(frozen=True)
class PerChannel:
    """One scale per index of ``axis``."""

    axis: int = 0


@dataclass(frozen=True)
class PerGroup:
    """One scale per ``group_size`` consecutive elements of each row of the ``[shape[axis], -1]`` view."""

    group_size: int = 128
    axis: int = 0


Granularity = PerTensor | PerChannel | PerGroup


class _NamesGranularity(Protocol):
    @property
    def granularity(self) -> str: ...
    @property
    def axis(self) -> int: ...
    @property
    def group_size(self) -> int: ...


def granularity_of(scheme: Scheme | _NamesGranularity) -> Granularity:
    """The granularity object a scheme (or a QuantizedTensor, which records the same fields) names."""
    if scheme.granularity == "tensor":
        return PerTensor()
    if scheme.granularity == "channel":
        return PerChannel(axis=scheme.axis)
    return PerGroup(group_size=scheme.group_size, axis=scheme.axis)


def granularity_name(gran: Granularity) -> str:
    if isinstance(gran, PerTensor):
        return "tensor"
    return "channel" if isinstance(gran, PerChannel) else "group"


def normalize_axis(axis: int, ndim: int, *, name: str) -> int:
    """``axis`` in ``[0, ndim)``; negative axes count from the end. ConfigError when out of range."""
    if ndim == 0:
        raise ConfigError(f"axis {axis} cannot apply to a 0-d tensor; use granularity 'tensor'",
                          tensor=name, field="axis")
    if not -ndim <= axis < ndim:
        raise ConfigError(f"axis {axis} is out of range for a {ndim}-d tensor", tensor=name, field="axis")
    return axis % ndim


def _row_view(x: torch.Tensor, gran: PerChannel | PerGroup, *, name: str) -> tuple[torch.Tensor, int]:
    """``[rows, cols]`` view of ``x`` for channel/group granularity, and the normalised axis."""
    if isinstance(gran, PerGroup) and x.dim() <= 1:
        return x.reshape(1, -1), 0
    axis = normalize_axis(gran.axis, x.dim(), name=name)
    v = x.movedim(axis, 0) if axis != 0 else x
    return v.reshape(x.shape[axis], -1), axis


def check_applicable(shape: tuple[int, ...], gran: Granularity, *, name: str) -> int:
    """Validate that ``gran`` applies to a tensor of ``shape``; returns the normalised axis.

    Raises ConfigError naming the tensor and the field (``shape``, ``axis``, ``group_size``).
    """
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        raise ConfigError(f"an empty tensor (shape {list(shape)}) cannot be quantized",
                          tensor=name, field="shape")
    if isinstance(gran, PerTensor):
        return 0
    if isinstance(gran, PerGroup) and len(shape) <= 1:
        axis, cols = 0, numel
    else:
        axis = normalize_axis(gran.axis, len(shape), name=name)
        cols = numel // shape[axis]
    if isinstance(gran, PerGroup) and cols % gran.group_size != 0:
        raise ConfigError(f"group_size {gran.group_size} does not divide the {cols} columns of the "
                          f"[shape[axis], -1] view of shape {list(shape)}", tensor=name, field="group_size")
    return axis


def scale_shape(shape: tuple[int, ...], gran: Granularity, *, name: str) -> tuple[int, ...]:
    """The CONTRACT §5 shape of the scale of a tensor of ``shape``."""
    axis = check_applicable(shape, gran, name=name)
    if isinstance(gran, PerTensor):
        return ()
    if isinstance(gran, PerChannel):
        return (shape[axis],)
    numel = 1
    for s in shape:
        numel *= s
    rows = 1 if len(shape) <= 1 else shape[axis]
    return (rows, numel // rows // gran.group_size)


def block_view(x: torch.Tensor, gran: Granularity, *, name: str) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Blocks ``[B, K]`` of ``x`` (a view when the layout allows, else a copy) and the scale shape."""
    sshape = scale_shape(tuple(x.shape), gran, name=name)
    if isinstance(gran, PerTensor):
        return x.reshape(1, -1), sshape
    v, _ = _row_view(x, gran, name=name)
    if isinstance(gran, PerChannel):
        return v, sshape
    return v.reshape(-1, gran.group_size), sshape


def unblock(blocks: torch.Tensor, x_shape: tuple[int, ...] | torch.Size, gran: Granularity) -> torch.Tensor:
    """Inverse of :func:`block_view`: blocks ``[B, K]`` back to a contiguous tensor of ``x_shape``."""
    shape = tuple(x_shape)
    if isinstance(gran, PerTensor) or (isinstance(gran, PerGroup) and len(shape) <= 1):
        return blocks.reshape(shape)
    axis = gran.axis % len(shape)
    moved = (shape[axis], *shape[:axis], *shape[axis + 1:])
    return blocks.reshape(moved).movedim(0, axis).contiguous()


def is_row_major(x: torch.Tensor, gran: Granularity) -> bool:
    """True when the block view is a plain reshape of contiguous memory (the fast path)."""
    if not x.is_contiguous():
        return False
    if isinstance(gran, PerTensor) or x.dim() <= 1:
        return True
    return gran.axis % x.dim() == 0
