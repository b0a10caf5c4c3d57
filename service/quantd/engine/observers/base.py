"""The observer registry and ``observe_range``, which every weight and activation range goes through."""

from __future__ import annotations

from collections.abc import Callable

import torch

from quantd.engine.kernels import KERNELS
from quantd.engine.kernels.quantize import row_range
from quantd.errors import MalformedInputError, NonFiniteError
from quantd_client import Scheme
from quantd_client._dtypes import DTypeInfo, dtype_info

# Float32 elements per temporary in the chunked searches (16 MB); a few temporaries live at once.
CHUNK_ELEMENTS = 1 << 22

# ``fn(x[B, K] float32, lo[B], hi[B], scheme, dtype info) -> (lo, hi)``: a range per block, given the
# blocks' min and max.
ObserverFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Scheme, DTypeInfo],
                      tuple[torch.Tensor, torch.Tensor]]

# Observer name → its range function; the names are exactly ``quantd_client._schemas.ObserverName``'s.
OBSERVERS: dict[str, ObserverFn] = {}


def register(name: str) -> Callable[[ObserverFn], ObserverFn]:
    """Register a range function under ``name`` (one name, one function)."""
    def add(fn: ObserverFn) -> ObserverFn:
        if name in OBSERVERS:
            raise ValueError(f"observer {name!r} is registered twice")
        OBSERVERS[name] = fn
        return fn
    return add


def observe_range(blocks: torch.Tensor, scheme: Scheme, *, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo[B], hi[B])`` float32 on ``blocks.device`` for the block view ``blocks[B, K]``."""
    if blocks.dim() != 2 or blocks.shape[0] == 0 or blocks.shape[1] == 0:
        raise MalformedInputError(f"observer needs a non-empty 2-D block view [B, K], got shape "
                                  f"{tuple(blocks.shape)}", tensor=name)
    x = blocks.float()
    # amin and amax separately: torch.aminmax over a dim is slower on CPU; one fused pass when the
    # compiled kernels run.
    fused = row_range(x) if KERNELS.wants(x) else None
    lo, hi = fused if fused is not None else (x.amin(dim=1), x.amax(dim=1))
    if not bool(torch.isfinite(lo).all() & torch.isfinite(hi).all()):
        raise NonFiniteError(f"tensor {name!r} has NaN or Inf values; cannot observe a range", tensor=name)
    info = dtype_info(scheme.dtype)
    if info.kind == "float":  # a plain cast: nothing to choose
        return lo, hi
    fn = OBSERVERS.get(scheme.observer)
    if fn is None:
        raise MalformedInputError(f"unknown observer {scheme.observer!r}", tensor=name, field="observer")
    return fn(x, lo, hi, scheme, info)
