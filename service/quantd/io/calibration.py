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
# Values checked for NaN/Inf this many at a time (bounds the boolean temporary).
_CHECK_CHUNK = 1 << 22


def _check_finite(x: torch.Tensor, name: str) -> None:
    """NonFiniteError naming calibration tensor ``name`` when it holds NaN or Inf (checked in chunks)."""
    flat = x.reshape(-1)
    bad = sum(int((~torch.isfinite(flat[i:i + _CHECK_CHUNK])).sum()) for i in range(0, flat.numel(), _CHECK_CHUNK))
    if bad:
        raise NonFiniteError(f"calibration tensor {name!r} has NaN or Inf values ({bad} of {flat.numel()})",
                             tensor=name)


def _check_count(count: torch.Tensor, name: str) -> int:
    """The number of rows a Hessian sums; MalformedInputError naming ``name`` unless it is ≥ 1."""
    n = int(count.reshape(-1)[0])
    if n < 1:
        raise MalformedInputError(f"calibration tensor {name!r} (the number of rows) must be ≥ 1, got {n}",
                                  tensor=name)
    return n


def _check_hessian(h: torch.Tensor, name: str) -> None:
    """A Hessian ``Σ x xᵀ``: finite, with a non-negative diagonal (each entry a sum of squares). A full
    positive semi-definiteness test (an eigendecomposition) is not made: the methods damp the diagonal."""
    _check_finite(h, name)
    diag = torch.diagonal(h)
    negative = int((diag < 0).sum())
    if negative:
        first = int(torch.nonzero(diag < 0)[0, 0])
        raise MalformedInputError(f"calibration tensor {name!r} is not a Hessian Σ x xᵀ: {negative} of its "
                                  f"{diag.numel()} diagonal entries are negative (the first at [{first}, {first}]: "
                                  f"{float(diag[first]):g})", tensor=name)


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
        """The index of the calibration file at ``path``, its values checked (:meth:`check_values`): what a
        job's submission asks before the job is accepted."""
        with cls(path) as cal:
            cal.check_values()
            return cal.index

    def check_values(self) -> None:
        """Every entry's values, one tensor at a time (memory follows the largest): input rows and Hessians
        finite, a Hessian's diagonal non-negative, each ``hessian_count`` ≥ 1. MalformedInputError (or
        NonFiniteError) naming the tensor otherwise: what the worker would refuse, before any work."""
        for entry in self.index.values():
            if entry.hessian is not None and entry.count is not None:
                _check_count(self._reader.load(entry.count, "cpu"), entry.count)
                _check_hessian(self._reader.load_transient(entry.hessian, "cpu"), entry.hessian)
            elif entry.rows is not None:
                _check_finite(self._reader.load_transient(entry.rows, "cpu"), entry.rows)

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
            count = _check_count(self._reader.load(entry.count, "cpu"), entry.count)
            _check_hessian(h, entry.hessian)
            return LayerHessian((h + h.T) / 2, count)
        if entry.rows is None:  # index_calibration gives every entry its rows or a Hessian with its count
            raise MalformedInputError(f"module {entry.module!r} has no usable calibration", tensor=entry.module)
        x = self._reader.load(entry.rows, device).reshape(-1, entry.features)
        _check_finite(x, entry.rows)
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
