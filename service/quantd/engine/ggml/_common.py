"""Shared bit-level helpers of the ggml block codecs: float16 fields, ggml's rounding functions."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from quantd.engine import kernels

# ggml's GROUP_MAX_EPS: a block whose largest magnitude is below this is all zero.
GROUP_MAX_EPS = 1e-15


class _KQuantKernels:
    """Whether the ggml types' kernels (the k-quants' searches and settles, the legacy types' fused pass) are
    taken in this process under ``QUANTD_COMPILE=auto``: ``built`` once a warm-up (:func:`building_kernels`)
    built them, so that no job waits on a compile, or once a one-shot run large enough to repay the build
    asked for them (:func:`take_kernels`)."""

    def __init__(self) -> None:
        self.built = threading.Event()
        self.warming = threading.Event()  # a warm-up is building them
        self.local = threading.local()  # .building: this thread is that warm-up


KQUANT_KERNELS = _KQuantKernels()


@contextlib.contextmanager
def building_kernels() -> Iterator[None]:
    """In the calling thread, the k-quant searches take the compiled kernels (and compile them) whatever
    ``QUANTD_COMPILE`` says; when the block ends without an error the kernels count as built for every
    thread (:func:`wants_kernels` under ``auto``)."""
    KQUANT_KERNELS.local.building = True
    KQUANT_KERNELS.warming.set()
    try:
        yield
    finally:
        KQUANT_KERNELS.local.building = False
        KQUANT_KERNELS.warming.clear()
    if kernels.KERNELS.available():  # not fallen back to eager while building
        KQUANT_KERNELS.built.set()


def take_kernels() -> None:
    """From now on in this process the ggml types take the compiled kernels under ``QUANTD_COMPILE=auto``,
    building on first use those not built yet: for a one-shot run that quantizes enough weights to repay the
    build (``quantd.runtime.use_kernels_for``)."""
    KQUANT_KERNELS.built.set()


def wants_kernels(x: torch.Tensor) -> bool:
    """Whether the k-quant searches and the legacy types' quantizers take the compiled kernels for ``x``. The
    k-quants' kernels take minutes to build on a cold cache (they gain about 2.6× on the benchmark's Q4_K_M model,
    ``bench/gguf_vs_llamacpp.py``), so no job waits on that compile: with ``QUANTD_COMPILE=1`` always; under
    ``auto`` (the default) once a server's or worker's warm-up has built them in this process
    (:func:`building_kernels`), and in that warm-up, or once a large one-shot run took them
    (:func:`take_kernels`); otherwise never."""
    setting = kernels.compile_setting()
    if setting == "off":
        return False
    if setting == "auto" and not (KQUANT_KERNELS.built.is_set() or getattr(KQUANT_KERNELS.local, "building", False)):
        return False
    return kernels.KERNELS.wants(x, small=True, cuda=False)  # eager on CUDA: no CUDA kernels of theirs


def f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """``[N]`` float32 → ``[N, 2]`` uint8: the little-endian IEEE half of each value (round to nearest even,
    as ``GGML_FP32_TO_FP16``)."""
    return v.to(torch.float16).contiguous().view(torch.uint8).reshape(-1, 2)


def f16_from(b: torch.Tensor) -> torch.Tensor:
    """``[N, 2]`` uint8 → ``[N]`` float32 (``GGML_FP16_TO_FP32``)."""
    return b.contiguous().view(torch.float16).reshape(-1).float()


_MAGIC = 12582912.0  # 1.5·2²³


def nearest_int(v: torch.Tensor) -> torch.Tensor:
    """ggml's ``nearest_int`` exactly: adding 1.5·2²³ to a float32 of magnitude below 2²² rounds it to an
    integer, half to even (``torch.round``'s result, at a fraction of its cost on CPU). Larger magnitudes
    stay larger than 2²² with their sign, which the callers' clamps to small code ranges absorb."""
    return (v + _MAGIC) - _MAGIC


def blend(take: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``where(take, new, old)`` for small integer-valued float tensors (codes) with ``take`` broadcast
    along rows: ``old + take·(new − old)`` is exact there and runs as plain vector arithmetic."""
    return old + take.to(old.dtype) * (new - old)


def roundf(v: torch.Tensor) -> torch.Tensor:
    """C's ``roundf`` (half away from zero) in exact float32 steps: ``floor(a) + floor(2·(a − floor(a)))``
    (``floor(a + 0.5)`` would round ``0.5 − 2⁻²⁵`` up in the addition)."""
    a = v.abs()
    fl = torch.floor(a)
    return torch.copysign(fl + torch.floor(2 * (a - fl)), v)


def pack_bits_le(bits: torch.Tensor) -> torch.Tensor:
    """``[N, 8k]`` of 0/1 → ``[N, k]`` uint8, bit ``j`` of byte ``i`` = ``bits[:, 8i + j]`` (numpy's
    ``packbits(bitorder="little")``)."""
    n = bits.shape[0]
    weights = (1 << torch.arange(8, device=bits.device, dtype=torch.int32))
    return (bits.to(torch.int32).reshape(n, -1, 8) * weights).sum(-1).to(torch.uint8)


def unpack_bits_le(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_bits_le`: ``[N, k]`` uint8 → ``[N, 8k]`` uint8 of 0/1."""
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8)
    return ((b.unsqueeze(-1) >> shifts) & 1).reshape(b.shape[0], -1)


def argmax_abs_value(x: torch.Tensor) -> torch.Tensor:
    """The signed value of largest magnitude in each row, the first one on ties (ggml's ``amax < fabsf(v)``)."""
    idx = x.abs().argmax(dim=-1, keepdim=True)
    return x.gather(-1, idx).squeeze(-1)


def sum_rows(t: torch.Tensor) -> torch.Tensor:
    """Σ over the first dim of a 2-D ``[n, S]`` tensor, as a ``[1, n] @ [n, S]`` product: ATen's reduction
    kernels run such short sums an order of magnitude slower than a matrix product on CPU. In a compiled graph
    a plain sum, which Inductor fuses with the ops that make ``t`` (Dynamo's flag, true only in the thread it
    traces in: eager callers keep the product while another thread compiles)."""
    if torch.compiler.is_dynamo_compiling():
        return t.sum(0)
    return (torch.ones(1, t.shape[0], dtype=t.dtype, device=t.device) @ t).squeeze(0)


def sum_last(t: torch.Tensor) -> torch.Tensor:
    """Σ over the last dim (any leading shape), as a product with a ones vector (see :func:`sum_rows`)."""
    if torch.compiler.is_dynamo_compiling():
        return t.sum(-1)
    n = t.shape[-1]
    flat = t.reshape(-1, n) @ torch.ones(n, 1, dtype=t.dtype, device=t.device)
    return flat.reshape(t.shape[:-1])
