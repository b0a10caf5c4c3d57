"""``output: "safetensors"``: quantd's own artifact (CONTRACT §5), one safetensors file whose
``__metadata__["quantd"]`` describes every quantized tensor. It holds every scheme quantd has."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from quantd_client import Scheme

from ..artifact import ArtifactWriter, OutputTensor, encode_quantized, quantized_layout, quantized_meta
from ..formats import torch_dtype
from . import register
from .base import OutputFormat, PlannedTensor, Sink

if TYPE_CHECKING:
    from quantd.engine.types import QuantizedTensor


@register
class QuantdSafetensors(OutputFormat):
    name = "safetensors"
    suffix = ".safetensors"
    description = "quantd's own artifact: packed codes, scales and zero points, dequantized with NumPy alone"

    def layout(self, name: str, shape: tuple[int, ...], scheme: Scheme) -> list[OutputTensor]:
        return quantized_layout(name, shape, scheme)

    def encode(self, qt: QuantizedTensor, name: str) -> dict[str, torch.Tensor]:
        return encode_quantized(qt, name)

    def open_sink(self, dst: str | os.PathLike[str], plans: Sequence[PlannedTensor], *,
                  extra_meta: Mapping[str, Any] | None = None) -> Sink:
        meta = {p.info.name: quantized_meta(p.info.shape, torch_dtype(p.info.dtype), p.scheme)
                for p in plans if p.scheme is not None}
        return ArtifactWriter(dst, [o for p in plans for o in p.outputs], meta, extra_meta=extra_meta)
