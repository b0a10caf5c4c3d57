"""What an output format is: the small protocol every module under ``io/outputs/`` implements.

A format decides, per input tensor, whether it can hold the planned scheme (``select``/``check``, run
for every tensor before any work starts, so a scheme it cannot express is a 422 naming the tensor and
the field), which tensors it writes for it (``layout``), how a :class:`QuantizedTensor` becomes those
tensors (``encode``), and the sink they stream into. A format may contribute ``config.json``'s
``quantization_config`` for model directories.
"""

from __future__ import annotations

import functools
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from quantd_client import Scheme

from ..artifact import OutputTensor
from ..formats import TORCH_TO_ST, torch_dtype
from ..readers import TensorInfo

if TYPE_CHECKING:
    from quantd.engine.types import QuantizedTensor


@dataclass(frozen=True)
class ModelStructure:
    """What a format may know of the model beyond its tensors: its Linear modules as the architecture that
    ``config.json`` describes names them (tied ones included: a tied ``lm_head`` has no tensor of its own),
    or None when unknown, and the architecture's ``base_model_prefix``."""

    linear_modules: frozenset[str] | None = None
    config: Mapping[str, Any] | None = None
    base_prefix: str = ""

    @functools.cached_property
    def linear_weights(self) -> frozenset[str] | None:
        """The Linear modules' weight names, with and without the base model's prefix (checkpoints of a task
        model name the base model's tensors either way), or None when unknown."""
        if self.linear_modules is None:
            return None
        names = {f"{n}.weight" for n in self.linear_modules}
        if self.base_prefix:
            pre = f"{self.base_prefix}."
            names |= {pre + n for n in names} | {n.removeprefix(pre) for n in names}
        return frozenset(names)


@dataclass(frozen=True)
class PlannedTensor:
    """One input tensor as a format plans it: the scheme it is quantized with (None: written as it is,
    ``reason`` says why) and the output tensors it becomes, in order."""

    info: TensorInfo
    scheme: Scheme | None
    reason: str | None
    outputs: tuple[OutputTensor, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.info.shape)


class Sink(Protocol):
    """Where a format's tensors go: each planned output tensor written once, then ``finish``."""

    @property
    def total_bytes(self) -> int: ...

    def write(self, name: str, tensor: torch.Tensor) -> None: ...

    def finish(self, summary: Mapping[str, Any] | None,
               tensor_stats: Mapping[str, Mapping[str, Any]] | None = None) -> int: ...

    def abort(self) -> None: ...

    def __enter__(self) -> Sink: ...

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None: ...


class OutputFormat(ABC):
    """One output format. Subclasses register themselves with :func:`quantd.io.outputs.register`."""

    name: ClassVar[str]
    #: the file suffix of its main file (storage, downloads, the CLI's default names)
    suffix: ClassVar[str] = ".safetensors"
    media_type: ClassVar[str] = "application/octet-stream"
    #: one-line description for ``/v1/info`` and the docs
    description: ClassVar[str] = ""

    def select(self, info: TensorInfo, scheme: Scheme | None, reason: str | None,
               structure: ModelStructure) -> tuple[Scheme | None, str | None]:
        """The scheme this format quantizes ``info`` with, given the config's choice: by default the
        config's. A format may leave more tensors as they are (with the reason), never quantize others."""
        return scheme, reason

    def check(self, name: str, shape: tuple[int, ...], scheme: Scheme) -> None:
        """ConfigError (tensor + field) when this format cannot hold ``scheme`` on this tensor.
        ``layout`` is planned right after, so shape rules of the scheme itself are checked there."""
        return None

    @abstractmethod
    def layout(self, name: str, shape: tuple[int, ...], scheme: Scheme) -> list[OutputTensor]:
        """The output tensors of ``name`` quantized with ``scheme``."""

    def optional_layout(self, name: str, shape: tuple[int, ...], scheme: Scheme) -> list[OutputTensor]:
        """Output tensors that only some results carry (the sink reserves room for them): none by default."""
        return []

    def passthrough(self, info: TensorInfo) -> list[OutputTensor]:
        """The output tensors of a tensor left as it is: itself, same dtype and shape."""
        return [OutputTensor(info.name, TORCH_TO_ST[torch_dtype(info.dtype)], info.shape)]

    @abstractmethod
    def encode(self, qt: QuantizedTensor, name: str) -> dict[str, torch.Tensor]:
        """The output tensors of one quantized tensor (names and dtypes as ``layout`` planned them)."""

    @abstractmethod
    def open_sink(self, dst: str | os.PathLike[str], plans: Sequence[PlannedTensor], *,
                  extra_meta: Mapping[str, Any] | None = None) -> Sink:
        """A sink writing ``dst`` (a temporary name first, renamed by ``finish``)."""

    #: True when a tensor's ``bits_per_weight`` is what :meth:`encode` writes for it (a layout that packs zero
    #: points or pads rows its own way) rather than the engine's count for quantd's artifact.
    bits_from_encoding: ClassVar[bool] = False

    #: True when the output is a model directory whose ``config.json`` this format completes
    writes_config: ClassVar[bool] = False

    def quantization_config(self, plans: Sequence[PlannedTensor], structure: ModelStructure, *,
                            written: Collection[str] = ()) -> dict[str, Any] | None:
        """What ``config.json`` gains under ``quantization_config`` (None: it is copied unchanged).
        ``written``: the names of the output tensors actually written (optional ones included)."""
        return None
