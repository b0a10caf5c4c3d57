"""ggml's quantized block types: one traits table (block size, bytes per block, quantize, dequantize, as
ggml's ``ggml_type_traits``) and the two verbs over whole tensors.

A tensor of shape ``[..., n]`` (ggml's row length ``n`` is the last dim) is cut into blocks of
``block_size`` consecutive elements of each row; every block of a chunk of rows is quantized in one set
of tensor ops. Chunks bound the temporaries (a search holds a few copies of its chunk), so memory
follows the tensor, not the search.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from quantd.engine import kernels
from quantd.errors import ConfigError

from . import kquants, legacy
from ._common import wants_kernels

BlockQuantizer = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
BlockDequantizer = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class GGMLType:
    """One ggml type: its GGUF id, ``block_size`` elements stored in ``type_size`` bytes."""

    name: str  # quantd dtype name, lower case (``q4_k``)
    type_id: int  # ggml_type / GGMLQuantizationType value
    block_size: int
    type_size: int
    quantize_blocks: BlockQuantizer  # [N, block_size] float32 (+ importance) → [N, type_size] uint8
    dequantize_blocks: BlockDequantizer  # [N, type_size] uint8 → [N, block_size] float32
    uses_importance: bool
    # The legacy types' quantizer of [N, block_size] float32 blocks, which compiles as it is: one fused pass
    # over a whole tensor where the kernels run (the same bytes); None for the k-quants.
    fused: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.type_size / self.block_size

    def row_bytes(self, n: int) -> int:
        return n // self.block_size * self.type_size


def _legacy(name: str, type_id: int, type_size: int, quantize: Callable[[torch.Tensor], torch.Tensor],
            dequantize: BlockDequantizer) -> GGMLType:
    def q(x: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
        return quantize(x)
    return GGMLType(name, type_id, legacy.QK, type_size, q, dequantize, False, quantize)


GGML_TYPES: dict[str, GGMLType] = {t.name: t for t in (
    _legacy("q4_0", 2, 18, legacy.quantize_q4_0, legacy.dequantize_q4_0),
    _legacy("q4_1", 3, 20, legacy.quantize_q4_1, legacy.dequantize_q4_1),
    _legacy("q5_0", 6, 22, legacy.quantize_q5_0, legacy.dequantize_q5_0),
    _legacy("q5_1", 7, 24, legacy.quantize_q5_1, legacy.dequantize_q5_1),
    _legacy("q8_0", 8, 34, legacy.quantize_q8_0, legacy.dequantize_q8_0),
    GGMLType("q2_k", 10, 256, 84, kquants.quantize_q2_k, kquants.dequantize_q2_k, True),
    GGMLType("q3_k", 11, 256, 110, kquants.quantize_q3_k, kquants.dequantize_q3_k, True),
    GGMLType("q4_k", 12, 256, 144, kquants.quantize_q4_k, kquants.dequantize_q4_k, True),
    GGMLType("q5_k", 13, 256, 176, kquants.quantize_q5_k, kquants.dequantize_q5_k, True),
    GGMLType("q6_k", 14, 256, 210, kquants.quantize_q6_k, kquants.dequantize_q6_k, True),
)}
GGML_BY_ID: dict[int, GGMLType] = {t.type_id: t for t in GGML_TYPES.values()}

# Elements per chunk of rows: a chunk's float32 copy (1 MiB) stays in a core's cache for the legacy types' few
# element-wise ops, and the searches' temporaries (a few chunk-sized float32 tensors) stay in the tens of MiB
# whatever the tensor.
CHUNK_ELEMENTS = 1 << 18
# The k-quants' chunks are twice that: their searches run a few hundred ops per chunk, many of them on the
# sub-blocks' scales (a 16th or 32nd of the chunk), whose cost is per op rather than per element; on tensors of
# 3–17 M weights these chunks take about 20 % less time (q2_k to q5_k; q6_k about even), with the same bytes.
KQUANT_CHUNK_ELEMENTS = 1 << 19


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _chunk_pool(threads: int) -> ThreadPoolExecutor:
    """CPU chunks run side by side, each op single-threaded: a chunk's few hundred small ops parallelised
    inside each op wait at every op's barrier for the slowest thread, which on a busy CPU (a descheduled
    thread) makes them many times slower than one thread; whole chunks per thread have no such barriers."""
    with _POOLS_LOCK:
        pool = _POOLS.get(threads)
        if pool is None:
            pool = _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="quantd-ggml",
                                                        initializer=torch.set_num_threads, initargs=(1,))
        return pool


T = TypeVar("T")


def rows_per_chunk(rows: int, n: int, elements: int) -> int:
    """Rows of ``n`` elements per chunk: ``elements`` worth, and at most half of ``rows``, so that a tensor of
    less than two chunks still gives two threads work. The split depends on the tensor alone, never on the
    machine: a search's float32 sums follow its chunk's shape, and with them, rarely, a byte of the output."""
    return max(1, min(elements // n, -(-rows // 2)))


def map_chunks(fn: Callable[[int], T], starts: range, device: torch.device) -> list[T]:
    """``fn`` over the chunk starts: on the single-threaded pool for CPU tensors when torch has several
    threads (see :func:`_chunk_pool`), else in order."""
    threads = torch.get_num_threads()
    if device.type == "cpu" and threads > 1 and len(starts) > 1:
        return list(_chunk_pool(threads).map(fn, starts))
    return [fn(r0) for r0 in starts]


@dataclass(frozen=True)
class GGMLQuantized:
    """A tensor in a ggml block type: ``data`` is ``[rows, row_bytes]`` uint8, ggml's bytes row by row
    (``rows`` = product of all dims but the last)."""

    ggml_type: GGMLType
    shape: tuple[int, ...]
    data: torch.Tensor


def ggml_type(name: str) -> GGMLType:
    try:
        return GGML_TYPES[name]
    except KeyError:
        raise ConfigError(f"unknown ggml type {name!r}; one of {sorted(GGML_TYPES)}", field="scheme.dtype") from None


def check_shape(t: GGMLType, shape: tuple[int, ...], *, name: str) -> None:
    """ggml blocks run along rows: the last dim must be a multiple of the block size."""
    if not shape or shape[-1] % t.block_size:
        raise ConfigError(f"{t.name} needs a row length (last dim) that is a multiple of {t.block_size}; "
                          f"tensor has shape {list(shape)}", field="scheme.dtype", tensor=name)


def quantize(x: torch.Tensor, t: GGMLType, *, importance: torch.Tensor | None = None,
             name: str = "tensor") -> GGMLQuantized:
    """Quantize ``x`` (any float dtype, any device) to ``t``. ``importance``: ``[n]`` non-negative weights
    of the row positions (llama.cpp's importance matrix for this tensor), used by the k-quants' searches."""
    shape = tuple(x.shape)
    check_shape(t, shape, name=name)
    n = shape[-1]
    rows = math.prod(shape[:-1])
    x2 = x.reshape(rows, n)
    imp = None
    if importance is not None and t.uses_importance:
        if importance.shape != (n,):
            raise ConfigError(f"importance matrix entry has {list(importance.shape)} values, the tensor's rows "
                              f"have {n}", field="calibration", tensor=name)
        imp = importance.to(device=x.device, dtype=torch.float32).reshape(1, n)
    if t.fused is not None and wants_kernels(x2):
        fused = kernels.KERNELS.call(f"ggml_quantize_{t.name}", t.fused, (), x2.float().reshape(-1, t.block_size))
        if fused is not None:
            return GGMLQuantized(t, shape, fused.reshape(rows, -1))
    out = torch.empty((rows, t.row_bytes(n)), dtype=torch.uint8, device=x.device)
    step = rows_per_chunk(rows, n, KQUANT_CHUNK_ELEMENTS if t.block_size == kquants.QK_K else CHUNK_ELEMENTS)

    def run(r0: int) -> None:
        chunk = x2[r0:r0 + step].float()
        k = chunk.shape[0]
        blocks = chunk.reshape(-1, t.block_size)
        w = None if imp is None else imp.expand(k, n).reshape(-1, t.block_size)
        out[r0:r0 + k] = t.quantize_blocks(blocks, w).reshape(k, -1)

    starts = range(0, rows, step)
    if t.block_size == kquants.QK_K and wants_kernels(x2):
        for r0 in starts:  # the compiled kernels hold the GIL: chunk threads would take turns
            run(r0)
    else:
        map_chunks(run, starts, x.device)  # chunks write disjoint rows of ``out``
    return GGMLQuantized(t, shape, out)


def dequantize(q: GGMLQuantized, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float values ggml's ``dequantize_row_*`` gives for ``q``'s bytes, in ``q.shape``."""
    t = q.ggml_type
    n = q.shape[-1]
    rows = q.data.shape[0]
    out = torch.empty((rows, n), dtype=dtype, device=q.data.device)
    step = rows_per_chunk(rows, n, CHUNK_ELEMENTS)

    def run(r0: int) -> None:
        b = q.data[r0:r0 + step]
        out[r0:r0 + b.shape[0]] = t.dequantize_blocks(b.reshape(-1, t.type_size)).reshape(b.shape[0], n).to(dtype)

    map_chunks(run, range(0, rows, step), q.data.device)
    return out.reshape(q.shape)


__all__ = ["CHUNK_ELEMENTS", "GGML_BY_ID", "GGML_TYPES", "KQUANT_CHUNK_ELEMENTS", "GGMLQuantized", "GGMLType",
           "check_shape", "dequantize", "ggml_type", "map_chunks", "quantize", "rows_per_chunk"]
