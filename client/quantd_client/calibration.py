"""Record the calibration the ``gptq`` and ``awq`` methods need from a torch model (CONTRACT §10).

::

    from quantd_client.calibration import CalibrationRecorder

    with CalibrationRecorder(model) as rec:        # hooks every torch.nn.Linear
        for batch in batches:
            model(**batch)
    rec.save("calibration.safetensors")           # M.hessian [in, in] and M.hessian_count per Linear M
    client.submit("model.safetensors", {"scheme": {"method": "gptq"}}, calibration="calibration.safetensors")

Each Linear's inputs are folded into ``H = Σ x xᵀ`` (float32, on the layer's device) as they pass, so the
file's size follows the layers' widths, not the number of calibration rows. torch is imported only when a
recorder is made; the rest of the SDK never needs it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["CalibrationRecorder", "write_safetensors"]

_ST_DTYPES = {np.dtype("float32"): "F32", np.dtype("int64"): "I64", np.dtype("float16"): "F16"}


def write_safetensors(path: str | os.PathLike[str], tensors: dict[str, npt.NDArray[Any]]) -> None:
    """Write NumPy arrays (float32, float16, int64) as a safetensors file, in the given order."""
    from ._artifact import safetensors_header

    arrays = {}
    for name, arr in tensors.items():
        a = np.asarray(arr)
        if not a.flags.c_contiguous:  # (np.ascontiguousarray would also make a 0-d count [1])
            a = a.copy(order="C")
        if a.dtype not in _ST_DTYPES:
            raise ValueError(f"{name}: dtype {a.dtype} is not one this writer stores")
        arrays[name] = a
    with open(path, "wb") as f:
        f.write(safetensors_header((n, _ST_DTYPES[a.dtype], a.shape, a.nbytes) for n, a in arrays.items()))
        for a in arrays.values():
            f.write(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())


class CalibrationRecorder:
    """Accumulates ``Σ x xᵀ`` of the inputs of a model's Linear layers while the user runs batches.

    ``modules``: the names (as in ``model.named_modules()``) to record; default every ``torch.nn.Linear``.
    ``include``: a predicate on the name to narrow the default. ``prefix`` is put before every name written
    (the weight file's names may carry one the module tree lacks, e.g. ``"bert."``). Use as a context
    manager (hooks are removed on exit), then :meth:`save` or :meth:`tensors`.
    """

    def __init__(self, model: Any, *, modules: Iterable[str] | None = None,
                 include: Callable[[str], bool] | None = None, prefix: str = "") -> None:
        import torch

        self._torch = torch
        self.prefix = prefix
        wanted = None if modules is None else set(modules)
        self.layers: dict[str, Any] = {}
        for name, mod in model.named_modules():
            if not isinstance(mod, torch.nn.Linear):
                continue
            if (wanted is not None and name not in wanted) or (include is not None and not include(name)):
                continue
            self.layers[name] = mod
        if wanted is not None and wanted - set(self.layers):
            raise ValueError(f"not Linear modules of the model: {sorted(wanted - set(self.layers))[:5]}")
        self.hessians: dict[str, Any] = {}
        self.counts: dict[str, int] = {}
        self._handles: list[Any] = []

    def _hook(self, name: str) -> Callable[..., None]:
        torch = self._torch

        def record(module: Any, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            x = x.reshape(-1, x.shape[-1]).float()
            h = self.hessians.get(name)
            if h is None:
                h = self.hessians[name] = torch.zeros(x.shape[1], x.shape[1], device=x.device)
            h.addmm_(x.T, x)
            self.counts[name] = self.counts.get(name, 0) + x.shape[0]

        return record

    def __enter__(self) -> CalibrationRecorder:
        for name, mod in self.layers.items():
            self._handles.append(mod.register_forward_pre_hook(self._hook(name)))
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def tensors(self) -> dict[str, npt.NDArray[Any]]:
        """``M.hessian`` (float32 ``[in, in]``) and ``M.hessian_count`` (int64 ``[]``) per recorded layer."""
        out: dict[str, npt.NDArray[Any]] = {}
        for name, h in self.hessians.items():
            out[f"{self.prefix}{name}.hessian"] = h.cpu().numpy().astype(np.float32)
            out[f"{self.prefix}{name}.hessian_count"] = np.asarray(self.counts[name], dtype=np.int64)
        return out

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`tensors` as the job's calibration file (safetensors)."""
        if not self.hessians:
            raise ValueError("nothing recorded: run the model on calibration batches inside the recorder's with block")
        write_safetensors(path, self.tensors())
