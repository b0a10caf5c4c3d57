"""A job's calibration file for the calibrated methods (GPTQ, AWQ; CONTRACT §10).

Per Linear module ``M`` (its weight's name without ``.weight``) the file holds either its input rows ``M``
(``[N, in]``, or ``[..., in]``: every leading dim is rows) or its Hessian ``M.hessian`` (``[in, in]``,
``Σ x xᵀ``) with ``M.hessian_count`` (an integer ``[]``: the number of rows). The index is read from the
header alone, so a missing or mis-shaped entry fails the config (422 naming the tensor) before any work;
each layer's Hessian is built when its weight is quantized, so memory follows one layer.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from quantd.errors import ConfigError, MalformedInputError, NonFiniteError
from quantd_client import QuantConfig

from .formats import QUANTIZABLE, torch_dtype
from .readers import ModelReader, TensorInfo, open_model

if TYPE_CHECKING:
    from quantd.engine.methods import LayerHessian

HESSIAN_SUFFIX = ".hessian"
COUNT_SUFFIX = ".hessian_count"
# Rows are turned into Σ x xᵀ this many at a time (bounds the float32 temporary).
_ROW_CHUNK = 1 << 14


def module_name(weight: str) -> str:
    """The module a weight belongs to: ``"layer.0.q.weight"`` → ``"layer.0.q"`` (other names as they are)."""
    return weight.removesuffix(".weight")


@dataclass(frozen=True)
class CalibrationEntry:
    """One module's calibration: its input rows or its Hessian (and count), by tensor name."""

    module: str
    features: int  # the layer's input width
    rows: str | None = None
    hessian: str | None = None
    count: str | None = None


def index_calibration(tensors: list[TensorInfo]) -> dict[str, CalibrationEntry]:
    """Module → entry, from the tensor list alone; MalformedInputError for entries that cannot be one."""
    names = {t.name: t for t in tensors}
    out: dict[str, CalibrationEntry] = {}
    for t in tensors:
        if t.name.endswith(COUNT_SUFFIX):
            if t.name.removesuffix(COUNT_SUFFIX) + HESSIAN_SUFFIX not in names:
                raise MalformedInputError(f"calibration tensor {t.name!r} has no {HESSIAN_SUFFIX} beside it",
                                          tensor=t.name)
            if math.prod(t.shape) != 1 or torch_dtype(t.dtype).is_floating_point:
                raise MalformedInputError(f"calibration tensor {t.name!r} must be one integer (the number of rows), "
                                          f"got {t.dtype} {list(t.shape)}", tensor=t.name)
            continue
        if torch_dtype(t.dtype) not in QUANTIZABLE:
            raise MalformedInputError(f"calibration tensor {t.name!r} must be floating point, got {t.dtype}",
                                      tensor=t.name)
        if t.name.endswith(HESSIAN_SUFFIX):
            module = t.name.removesuffix(HESSIAN_SUFFIX)
            count = module + COUNT_SUFFIX
            if len(t.shape) != 2 or t.shape[0] != t.shape[1] or t.shape[0] == 0:
                raise MalformedInputError(f"calibration tensor {t.name!r} must be a square [in, in] Hessian, got "
                                          f"{list(t.shape)}", tensor=t.name)
            if count not in names:
                raise MalformedInputError(f"calibration tensor {t.name!r} needs {count!r} (the number of rows)",
                                          tensor=t.name)
            entry = CalibrationEntry(module, t.shape[0], hessian=t.name, count=count)
        else:
            module = t.name
            if len(t.shape) < 2 or math.prod(t.shape) == 0:
                raise MalformedInputError(f"calibration tensor {t.name!r} must be input rows [N, in], got "
                                          f"{list(t.shape)}", tensor=t.name)
            entry = CalibrationEntry(module, t.shape[-1], rows=t.name)
        if module in out:
            raise MalformedInputError(f"module {module!r} has both input rows and a Hessian in the calibration file",
                                      tensor=t.name)
        out[module] = entry
    return out


def check_against(index: dict[str, CalibrationEntry], weight: str, shape: tuple[int, ...]) -> bool:
    """Whether ``weight`` has calibration; ConfigError when it has but of another input width."""
    entry = index.get(module_name(weight))
    if entry is None:
        return False
    if len(shape) != 2 or shape[1] != entry.features:
        raise ConfigError(f"the calibration of module {entry.module!r} has {entry.features} input features, the "
                          f"weight has shape {list(shape)}", field="calibration", tensor=weight)
    return True


class MethodCalibration:
    """An open calibration file: :meth:`layer` builds one module's :class:`LayerHessian` on a device."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._reader: ModelReader = open_model(path)
        try:
            self.index = index_calibration(self._reader.tensors)
        except BaseException:
            self._reader.close()
            raise

    @classmethod
    def describe(cls, path: str | os.PathLike[str]) -> dict[str, CalibrationEntry]:
        with cls(path) as cal:
            return cal.index

    @property
    def has_hessians(self) -> bool:
        return any(e.hessian is not None for e in self.index.values())

    def layer(self, weight: str, device: torch.device) -> LayerHessian | None:
        from quantd.engine.methods import LayerHessian

        entry = self.index.get(module_name(weight))
        if entry is None:
            return None
        if entry.hessian is not None and entry.count is not None:
            h = self._reader.load(entry.hessian, device).float()
            count = int(self._reader.load(entry.count, "cpu").reshape(-1)[0])
            if count < 1:
                raise MalformedInputError(f"calibration tensor {entry.count!r} must be ≥ 1, got {count}",
                                          tensor=entry.count)
            if not bool(torch.isfinite(h).all()):
                raise NonFiniteError(f"calibration tensor {entry.hessian!r} has NaN or Inf values", tensor=entry.hessian)
            return LayerHessian((h + h.T) / 2, count)
        if entry.rows is None:  # index_calibration gives every entry its rows or a Hessian with its count
            raise MalformedInputError(f"module {entry.module!r} has no usable calibration", tensor=entry.module)
        x = self._reader.load(entry.rows, device).reshape(-1, entry.features)
        if not bool(torch.isfinite(x).all()):
            raise NonFiniteError(f"calibration tensor {entry.rows!r} has NaN or Inf values", tensor=entry.rows)
        h = torch.zeros(entry.features, entry.features, device=device)
        for r in range(0, x.shape[0], _ROW_CHUNK):
            chunk = x[r:r + _ROW_CHUNK].float()
            h.addmm_(chunk.T, chunk)
        return LayerHessian(h, x.shape[0])

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> MethodCalibration:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def uses_calibrated_method(config: QuantConfig) -> bool:
    """Whether the default scheme or a rule names a method that needs calibration."""
    from quantd.engine.methods import METHODS

    names = {config.scheme.method} | {r.scheme.method for r in config.rules if r.scheme and r.scheme.method}
    return any(METHODS[n].needs != "none" for n in names if n in METHODS)
