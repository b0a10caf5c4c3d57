"""The formulas that set codes and scales divide by tensors (or by powers of two), never by another Python number.

CUDA turns a division by a number into a multiplication by its rounded reciprocal (torch's eager ops when the
divisor is a host scalar, Inductor's CUDA kernels when it is a constant of the graph), which is not the quotient
rounded once: scales, and so codes, would then differ from the CPU's. This checks on any machine, on the eager
path and through the compiled kernels' own functions, what tests/engine/test_cuda.py checks on a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from _device_schemes import DEVICE_SCHEMES
from quantd.engine import kernels
from quantd.engine.primitives import quantize
from quantd_client import Scheme

SCHEMES = DEVICE_SCHEMES

_DIVISIONS = {"div", "div_", "__truediv__", "__itruediv__", "true_divide", "divide"}


class _NumberDivisors(TorchFunctionMode):
    """Records each division whose divisor is a Python number other than a power of two (those divide exactly
    as multiplications)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[float] = []

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _DIVISIONS:
            divisor = args[1] if len(args) > 1 else kwargs.get("other")
            if isinstance(divisor, (int, float)) and divisor != 0 and math.frexp(abs(divisor))[0] != 0.5:
                self.found.append(float(divisor))
        return func(*args, **kwargs)


@pytest.fixture(params=["eager", "kernel functions"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The eager formulas, or the compiled kernels' functions (run as Python: what Dynamo would trace). The
    kernels' store is the test's own: no later test finds a plain function where it expects a compiled one."""
    monkeypatch.setattr(kernels.KERNELS, "_fns", {})
    monkeypatch.setattr(kernels.KERNELS, "_warm", set())
    if request.param == "eager":
        kernels.KERNELS.reset(available=False)
    else:
        monkeypatch.setattr(kernels, "MIN_ELEMENTS", 0)
        monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
        kernels.KERNELS.reset(available=True)
    yield request.param
    kernels.KERNELS.reset()


@pytest.mark.parametrize("spec", SCHEMES, ids=lambda s: "-".join(str(v) for v in s.values()))
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_scales_and_codes_never_divide_by_a_number(spec: dict[str, Any], in_dtype: torch.dtype, path: str) -> None:
    x = (torch.randn(64, 768, generator=torch.Generator().manual_seed(0)) * 0.02).to(in_dtype)  # 768: no power of 2
    mode = _NumberDivisors()
    with mode:
        quantize(x, Scheme.model_validate(spec))
    if path != "eager" and spec["dtype"] not in ("float16", "bfloat16"):  # (a float cast has no kernels)
        assert kernels.KERNELS._warm, "the kernel functions did not run"
    assert mode.found == [], f"divisions by {sorted(set(mode.found))}"


def test_the_check_sees_a_division_by_a_number() -> None:
    mode = _NumberDivisors()
    with mode:
        _ = torch.ones(3) / 7.5
        _ = torch.ones(3) / 4.0  # a power of two divides exactly either way
        _ = torch.ones(3) / torch.full((), 7.5)
    assert mode.found == [7.5]
