"""Fused CPU kernels: the engine's hot loops compiled by ``torch.compile`` (Inductor's C++ backend).

Eager torch runs one pass over memory per op: for an int8 per-channel weight that is amin, amax,
divide, add, clamp and a store, each reading the chunk again, and it tops out near 55 % of a plain
copy on a 2-core CPU. Compiled, the per-block range is one pass (min and max together, with the
conversion from bf16/fp16 folded in), the blocks' qparams one pass over ``[B]`` (``choose_qparams``'
float64 steps, a dozen eager ops), and the encode one more over the weight (divide, round, clamp,
store). The weight is read twice: a kernel that observes and encodes each row while it is in cache
is not what Inductor generates (it emits one loop over all rows per stage, and was measured no faster).
The rest of a tensor's trip through the pipeline is fused the same way:
dequantize (one pass from codes to floats), packing (codes straight to the bitstream, no offsets
tensor), the error statistics (every float64 sum of a chunk in one pass over ``x`` and ``x̂``; the
outlier count in one more) and the mse observer's candidate errors.

The kernels compute exactly what the eager formulas in :mod:`quantd.engine.primitives` compute
(IEEE division, round half to even, the same clamp; tests compare them bit for bit), so whether a
tensor took the compiled or the eager path never shows in its codes, scales, packed bytes or ``x̂``.
The statistics' float64 sums may differ from the eager ones in the last bits (another summation
order; tests hold them to 1e-12 relative); the counts are exact.

When they run: on CPU tensors of at least :data:`MIN_ELEMENTS` elements, when a C++ compiler is
found and ``QUANTD_COMPILE`` is not ``0``. CUDA tensors stay on the eager ops. The first call of each
kernel compiles it (seconds; Inductor caches the result on disk for later processes); any failure
to compile or run switches the process to the eager path for good, with one warning.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from quantd_client._dtypes import NF4_CODEBOOK, DTypeInfo, dtype_info

log = logging.getLogger(__name__)

# Compiled variants kept per kernel (input dtype × output dtype × layout); past Dynamo's default of 8 a
# kernel would silently run eager.
RECOMPILE_LIMIT = 64

# Below this many elements the eager path's per-call cost is small, and a cold compile is not worth it.
MIN_ELEMENTS = 1 << 18
# Kernels that beat eager torch on small tensors too take them from this size: the one-call min-max
# kernel of integer and nf4 dtypes (1.7–2x faster than eager at 64×64 to 256×256), and the mse search,
# which runs a dozen kernels per tensor (3.6x faster at 384×384 at g64).
SMALL_MIN_ELEMENTS = 1 << 12

# The nf4 levels rounded to float32, and the midpoints between consecutive levels computed in float32: the
# host constants of the nf4 kernels (and of the eager encode, ``primitives``).
NF4_LEVELS: tuple[float, ...] = tuple(torch.tensor(NF4_CODEBOOK, dtype=torch.float32).tolist())
NF4_MIDPOINTS: tuple[float, ...] = tuple(((torch.tensor(NF4_LEVELS[1:]) + torch.tensor(NF4_LEVELS[:-1])) / 2).tolist())
# Half the gap between the levels 2p and 2p + 1 (p = 0..7), rounded to float32 (the nf4 error kernel).
NF4_HALF_GAPS: tuple[float, ...] = tuple(float(torch.tensor((NF4_LEVELS[2 * p + 1] - NF4_LEVELS[2 * p]) / 2,
                                                            dtype=torch.float32)) for p in range(8))
# Their float32 bit patterns as int32 values, for the error kernel's bitwise selects.
NF4_MIDPOINT_BITS: tuple[int, ...] = tuple(torch.tensor(NF4_MIDPOINTS, dtype=torch.float32).view(torch.int32).tolist())
NF4_HALF_GAP_BITS: tuple[int, ...] = tuple(torch.tensor(NF4_HALF_GAPS, dtype=torch.float32).view(torch.int32).tolist())

FP8_TORCH_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

T = TypeVar("T")

# dynamic_threads: every kernel gets an OpenMP parallel loop and the OpenMP runtime picks the threads.
# Otherwise Inductor decides serial vs parallel once, from the sizes of a kernel's first call: one first
# compiled on a tiny tensor stays serial for every later tensor of any size, in this process and, through
# Inductor's disk cache, in every later one. Per compiled function (``options``), not a global config patch.
INDUCTOR_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {"cpp.dynamic_threads": True}


def _range(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = blocks.float()
    return x.amin(dim=1), x.amax(dim=1)


def _encode_int(blocks: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: torch.Tensor,
                qmax: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    q = torch.round(blocks.float() / scale) + zero_point
    return q.clamp(qmin, qmax).to(out_dtype)


def _select(bits: list[torch.Tensor], values: list[float]) -> torch.Tensor | float:
    """``values[i]`` where ``i`` is the binary number ``bits`` (most significant first), as nested wheres."""
    if not bits:
        return values[0]
    half = len(values) // 2
    return torch.where(bits[0], _select(bits[1:], values[half:]), _select(bits[1:], values[:half]))


def _nf4_bits(v: torch.Tensor, mids: tuple[float, ...]) -> list[torch.Tensor]:
    """The nf4 code of ``v`` (the number of the 15 sorted midpoints below it) as 4 bits, most significant
    first, by binary search: each comparison against the midpoint the bits before it select (11 selects
    in all). Each step halves the midpoints that ``v`` may still exceed; NaN compares false: code 0."""
    bits: list[torch.Tensor] = []
    half = (len(mids) + 1) // 2
    while half:  # this step's threshold for each prefix p of bits: mids[p·2·half + half − 1]
        bits.append(v > _select(bits, [mids[p * 2 * half + half - 1] for p in range(len(mids) // (2 * half) + 1)]))
        half //= 2
    return bits


def _encode_nf4(blocks: torch.Tensor, scale: torch.Tensor, mids: tuple[float, ...]) -> torch.Tensor:
    """The nf4 codes of ``x / scale`` from :func:`_nf4_bits`: 4 comparisons instead of 15 compare-and-add
    passes (3.7 against 6.7 ms on a 4096² weight)."""
    bits = _nf4_bits(blocks.float() / scale, mids)
    idx = torch.where(bits[0], 8.0, 0.0)  # summed in float32: uint8 adds do not vectorise here (8x slower)
    for weight, bit in zip((4.0, 2.0, 1.0), bits[1:], strict=True):
        idx = idx + torch.where(bit, weight, 0.0)
    return idx.to(torch.uint8)


def _encode_fp8(blocks: torch.Tensor, scale: torch.Tensor, max_finite: float, out_dtype: torch.dtype) -> torch.Tensor:
    return (blocks.float() / scale).clamp(-max_finite, max_finite).to(out_dtype)


class _Compiled:
    """Lazily compiled kernels, one lock for compiling, and the switch back to eager."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fns: dict[str, Callable[..., Any]] = {}
        self._warm: set[tuple[Any, ...]] = set()
        self._broken: str | None = None
        self._available: bool | None = None
        self._exhausted: set[str] = set()  # kernels past their recompile limit: eager from then on

    def available(self) -> bool:
        if self._available is None:
            setting = os.environ.get("QUANTD_COMPILE", "auto").strip().lower()
            compiler = os.environ.get("CXX") or "c++"
            self._available = setting not in ("0", "false", "off", "no") and shutil.which(compiler) is not None
        return self._available and self._broken is None

    def wants(self, x: torch.Tensor, *, small: bool = False) -> bool:
        """Whether ``x`` takes the compiled kernels: a CPU tensor of at least ``MIN_ELEMENTS`` elements
        (``SMALL_MIN_ELEMENTS`` for the kernels that pay off on ``small`` ones), when compiling is on."""
        least = min(MIN_ELEMENTS, SMALL_MIN_ELEMENTS) if small else MIN_ELEMENTS
        return x.device.type == "cpu" and x.numel() >= least and self.available()

    def call(self, name: str, fn: Callable[..., T], key: tuple[Any, ...], *args: Any,
             options: dict[str, Any] | None = None) -> T | None:
        """``fn(*args)`` compiled (with Inductor ``options`` on top of :data:`INDUCTOR_OPTIONS`), or None when
        compiling is off or failed (the caller runs eager)."""
        if not self.available() or name in self._exhausted:
            return None
        key = (*key, torch.get_num_threads())  # Dynamo recompiles when the thread count changes
        try:
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                if (name, *key) in self._warm:
                    return self._fns[name](*args)  # type: ignore[no-any-return]
                with self._lock:  # the first call of a variant compiles: one thread at a time
                    compiled = self._fns.get(name)
                    if compiled is None:
                        compiled = self._fns[name] = torch.compile(fn, dynamic=True, fullgraph=True,
                                                                   options={**INDUCTOR_OPTIONS, **(options or {})})
                    with warnings.catch_warnings():  # the compiler's own warnings are not ours to raise
                        warnings.simplefilter("ignore")
                        out = compiled(*args)
                    self._warm.add((name, *key))
                    return out  # type: ignore[no-any-return]
        except torch._dynamo.exc.FailOnRecompileLimitHit:  # this kernel's variants are used up, not the toolchain
            self._exhausted.add(name)
            log.warning("compiled kernel %r has %d variants in this process: it runs eager from now on",
                        name, RECOMPILE_LIMIT)
            return None
        except Exception as e:  # any compiler or toolchain failure: fall back, never fail the job
            self._broken = f"{type(e).__name__}: {e}"
            log.warning("compiled kernels disabled, using eager torch: %s", self._broken.splitlines()[0][:300])
            return None

    def reset(self, *, available: bool | None = None) -> None:
        """Forget the failure state (and optionally force availability): for tests."""
        self._broken = None
        self._available = available
        self._exhausted.clear()


KERNELS = _Compiled()


def row_range(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-row (min, max) of ``blocks`` in float32, one pass; None when not compiled (run eager)."""
    return KERNELS.call("range", _range, (blocks.dtype,), blocks)


def _code_bounds(qmin: int | None, qmax: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """An integer dtype's code range as 0-d float32 tensors (zeros for other dtypes). The bounds go into the
    kernels as tensors, not constants: one compiled kernel serves every bit width (Dynamo recompiles per
    constant value, and stops compiling a function after a few variants)."""
    return (torch.tensor(float(qmin or 0), dtype=torch.float32), torch.tensor(float(qmax or 0), dtype=torch.float32))


def encode_int(blocks: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int,
               out_dtype: torch.dtype) -> torch.Tensor | None:
    """``clamp(round(x / scale) + zero_point, qmin, qmax)`` as ``out_dtype``; scale/zero point are float32
    columns ``[B, 1]``."""
    lo, hi = _code_bounds(qmin, qmax)
    return KERNELS.call("int", _encode_int, (blocks.dtype, out_dtype), blocks, scale, zero_point, lo, hi, out_dtype)


def _qparams_columns(lo: torch.Tensor, hi: torch.Tensor, dtype: str, symmetric: bool,
                     scale_dtype: str) -> tuple[torch.Tensor, ...]:
    from quantd.engine.qparams import choose_qparams

    scale, zero_point = choose_qparams(lo, hi, dtype=dtype, symmetric=symmetric, scale_dtype=scale_dtype)
    s = scale.float().unsqueeze(1)
    z = torch.zeros_like(s) if zero_point is None else zero_point.float().unsqueeze(1)
    finite = torch.isfinite(lo).all() & torch.isfinite(hi).all()
    if zero_point is None:
        return finite, scale, s, z
    return finite, scale, s, z, zero_point


def qparams_columns(lo: torch.Tensor, hi: torch.Tensor, *, dtype: str, symmetric: bool, scale_dtype: str
                    ) -> tuple[bool, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``choose_qparams`` of the block ranges ``lo``/``hi`` ``[B]`` with what the encode kernels take:
    whether every ``lo``/``hi`` is finite, the scale (``scale_dtype``), the zero point (None when
    symmetric or not an integer dtype), and scale and zero point as float32 columns ``[B, 1]`` (zeros
    when symmetric), in one compiled kernel (eager when not compiled). Eager, these are a dozen passes
    over ``[B]``: 2–4x slower for the 262 144 groups of a 4096² weight at g64."""
    args = (lo, hi, dtype, symmetric, scale_dtype)
    out = KERNELS.call("qparams", _qparams_columns, (lo.dtype, dtype, symmetric, scale_dtype), *args)
    finite, scale, s, z, *zp = _qparams_columns(*args) if out is None else out
    return bool(finite), scale, (zp[0] if zp else None), s, z


# The dtypes whose min-max quantization runs as one compiled call (:func:`quantize_minmax`). fp8 keeps three
# calls: in one, per channel, it measured 9 % slower on a 4096² weight (per group of 128, 3 % faster).
ONE_CALL_MINMAX_KINDS = frozenset({"int", "nf4"})


def _quantize_minmax(blocks: torch.Tensor, kind: str, dtype: str, symmetric: bool, scale_dtype: str,
                     qmin: torch.Tensor, qmax: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    x = blocks.float()
    if symmetric:  # only max(|lo|, |hi|) counts (always so for nf4): one reduction, not two
        absmax = x.abs().amax(dim=1)
        lo, hi = -absmax, absmax
    else:
        lo, hi = x.amin(dim=1), x.amax(dim=1)
    finite, scale, s, z, *zp = _qparams_columns(lo, hi, dtype, symmetric, scale_dtype)
    if kind == "nf4":
        codes = _encode_nf4(x, s, NF4_MIDPOINTS)
    elif symmetric and dtype_info(dtype).signed:  # (Scheme refuses symmetric unsigned dtypes)
        # |x| ≤ absmax ≤ s·(qmax + ½), so round(x / s) ≥ qmin (−qmax − ½ rounds to the even −qmax − 1) and only
        # the top needs the clamp: each clamp is three vector ops (a NaN-propagating min or max), and the
        # encode of a bfloat16 weight is compute-bound: 13–15 % faster on a 4096² one (float32: 2 %).
        codes = torch.round(x / s).clamp(max=qmax).to(out_dtype)
    else:
        codes = _encode_int(x, s, z, qmin, qmax, out_dtype)
    # s is returned (and dropped by the caller) to make it a float32 buffer: otherwise the encode loop reads the
    # float16 scale and converts it anew for each vector it stores (its int8 stores may alias the scale, so the
    # compiler cannot hoist the load): 3–8 % of a bfloat16 weight's time.
    return (codes, finite, scale, s, *zp)


def quantize_minmax(blocks: torch.Tensor, info: DTypeInfo, *, dtype: str, symmetric: bool, scale_dtype: str,
                    out_dtype: torch.dtype) -> tuple[torch.Tensor, bool, torch.Tensor, torch.Tensor | None] | None:
    """Min-max quantization of all blocks ``[B, K]`` of an integer or nf4 dtype (:data:`ONE_CALL_MINMAX_KINDS`)
    in one compiled call: the blocks' ranges (one loop over the weight; symmetric schemes reduce ``|x|``
    only, one reduction instead of two: 9 % faster at g64), their qparams (one over ``[B]``) and the codes
    (one more over the weight). The same loops as :func:`row_range`, :func:`qparams_columns` and
    :func:`encode_int` / :func:`encode_nf4` called one after the other, without the three calls' overheads
    and temporaries (on a 4096² weight 11–17 % faster for integer dtypes, 9 % for nf4 g64). Returns codes,
    whether every range is finite, scale and zero point (None when symmetric or nf4); None when not
    compiled."""
    lo_q, hi_q = _code_bounds(info.qmin, info.qmax)
    out = KERNELS.call("minmax", _quantize_minmax, (blocks.dtype, dtype, symmetric, scale_dtype, out_dtype),
                       blocks, info.kind, dtype, symmetric, scale_dtype, lo_q, hi_q, out_dtype)
    if out is None:
        return None
    codes, finite, scale, _, *zp = out
    return codes, bool(finite), scale, (zp[0] if zp else None)


def encode_nf4(blocks: torch.Tensor, scale: torch.Tensor, mids: tuple[float, ...]) -> torch.Tensor | None:
    """nf4 codes: the number of codebook midpoints below ``x / scale``."""
    return KERNELS.call("nf4", _encode_nf4, (blocks.dtype,), blocks, scale, mids)


def encode_fp8(blocks: torch.Tensor, scale: torch.Tensor, max_finite: float,
               out_dtype: torch.dtype) -> torch.Tensor | None:
    """fp8 codes: ``x / scale`` clamped to ±max_finite and cast."""
    return KERNELS.call("fp8", _encode_fp8, (blocks.dtype, out_dtype), blocks, scale, max_finite, out_dtype)


def _code_error(t: torch.Tensor, q: torch.Tensor | float, scale: torch.Tensor, norm: float) -> torch.Tensor:
    """``sⁿ · Σ_k |t − q|ⁿ``: the error ``x − x̂ = s·(t − q)`` summed in the code domain."""
    d = t - q
    e = (d * d).sum(-1) if norm == 2.0 else d.abs().pow(norm).sum(-1)
    return e * scale.pow(norm)


def _fake_quant_error_int(x: torch.Tensor, scale: torch.Tensor, inv_scale: torch.Tensor, zero_point: torch.Tensor,
                          qmin: torch.Tensor, qmax: torch.Tensor, norm: float) -> torch.Tensor:
    t = x.unsqueeze(0) * inv_scale.unsqueeze(-1) + zero_point.unsqueeze(-1)
    return _code_error(t, torch.round(t).clamp(qmin, qmax), scale, norm)


def _fake_quant_error_nf4(x: torch.Tensor, scale: torch.Tensor, inv_scale: torch.Tensor, mids: tuple[float, ...],
                          mid_bits: tuple[int, ...], half_gap_bits: tuple[int, ...], norm: float) -> torch.Tensor:
    # The pair p of levels a < b (2p, 2p + 1) that t falls in is the number of the odd midpoints
    # mids[1], mids[3], … below it; the nearer of a and b is m ± h (m = mids[2p], h = (b − a)/2), so
    # |t − level| = ||t − m| − h| (m ± h is a or b to within an ulp). m and h come from two chains of 7
    # selects on 7 comparisons against constants, all independent of each other: 23–30 % faster than a binary
    # search (3 comparisons, each waiting on the selects of its threshold, then 7 selects each for m and h).
    # Each comparison is the sign of mids[2p − 1] − t spread over an int32 (an arithmetic shift: all ones
    # when t is above), and each select picks the bits of m and h by it (``m ^ ((m ^ v) & mask)``, one
    # ternary-logic instruction on AVX-512): a ``torch.where`` on a comparison keeps its mask as a vector
    # and converts it back to a mask register for every select, 14 more instructions per 16 values: the
    # error kernel alone took 14.0 against 12.3 ms for 4 candidates of 4096² at g64 (2 threads). The sign of
    # a float32 difference is that of the comparison (it is +0 when they are equal), so the pairs are those
    # of ``t > mids[2p − 1]``; NaN values give NaN errors either way.
    t = x.unsqueeze(0) * inv_scale.unsqueeze(-1)
    m: torch.Tensor | int = mid_bits[0]
    h: torch.Tensor | int = half_gap_bits[0]
    for p in range(1, len(half_gap_bits)):
        above = (mids[2 * p - 1] - t).view(torch.int32) >> 31
        m = m ^ ((m ^ mid_bits[2 * p]) & above)
        h = h ^ ((h ^ half_gap_bits[p]) & above)
    assert isinstance(m, torch.Tensor) and isinstance(h, torch.Tensor)
    return _code_error((t - m.view(torch.float32)).abs(), h.view(torch.float32), scale, norm)


def _round_fp8(v: torch.Tensor, mant: int, emin: int) -> torch.Tensor:
    """``v`` (float32, within the fp8 dtype's finite range) rounded to the nearest value of an fp8 dtype
    with ``mant`` mantissa bits and smallest normal exponent ``emin``, ties to even: the value of
    ``v.to(float8).float()``, in arithmetic that vectorises. The grid step at ``v`` is ``2^(e − mant)``
    for ``v``'s exponent ``e`` (at least ``emin``: the subnormals' step below), taken from ``v``'s bits
    with its reciprocal, both powers of two: ``round(v · 2^(mant − e)) · 2^(e − mant)`` is exact but for
    the rounding. Inductor's C++ backend converts to float8 one element at a time (3x slower here)."""
    exponent = torch.clamp(v.view(torch.int32) & 0x7F800000, min=(emin + 127) << 23)
    step = (exponent - (mant << 23)).view(torch.float32)
    inv_step = (((254 + mant) << 23) - exponent).view(torch.float32)
    return torch.round(v * inv_step) * step


def _fake_quant_error_fp8(x: torch.Tensor, scale: torch.Tensor, inv_scale: torch.Tensor, max_finite: float,
                          mant: int, emin: int, norm: float) -> torch.Tensor:
    t = x.unsqueeze(0) * inv_scale.unsqueeze(-1)
    return _code_error(t, _round_fp8(t.clamp(-max_finite, max_finite), mant, emin), scale, norm)


def fp8_format(dtype: str) -> tuple[int, int]:
    """An fp8 dtype's mantissa bits and smallest normal exponent (e4m3: 3, −6; e5m2: 2, −14)."""
    finfo = torch.finfo(FP8_TORCH_DTYPES[dtype])
    return -math.frexp(finfo.eps)[1] + 1, math.frexp(finfo.tiny)[1] - 1


# Inductor stores a pointwise result of more than 50 ops that a reduction reads as a temporary (on CPU): the
# nf4 error's selects are more, and a [C, B, K] temporary made that kernel 4x slower. It stays in the loop.
NO_REALIZE: dict[str, Any] = {"realize_cpu_opcount_threshold": 1000}


# Block lengths (values per block) that :func:`fix_block_length` makes a compiled kernel's constant: the usual
# group sizes. Each is a variant of its own, compiled on first use (seconds).
FIXED_BLOCK_LENGTHS = (32, 64, 128, 256)


def fix_block_length(blocks: torch.Tensor) -> int | None:
    """Have the kernels called on ``blocks[B, K]`` compiled for its block length ``K`` as a constant when it
    is one of :data:`FIXED_BLOCK_LENGTHS`, and return it (None: ``K`` stays symbolic, one variant for every
    other length). The C++ compiler then unrolls the loop over a block's values, which the nf4 error kernel's
    long body needs: a 4-candidate mse step of nf4 g64 on a 4096² weight took 9.5–9.8 against 14.0–14.1 ms
    (2 threads, three runs each). The integer dtypes' mse steps gained nothing from it (4096², g64/g128)
    and keep one variant for every length."""
    k = int(blocks.shape[1])
    if k not in FIXED_BLOCK_LENGTHS:
        return None
    torch._dynamo.mark_static(blocks, 1)
    return k


def error_args(info: DTypeInfo, dtype: str) -> tuple[torch.Tensor, torch.Tensor, str, tuple[float, int, int]]:
    """What :func:`candidate_error` takes besides the blocks and candidates for ``dtype``: an integer
    dtype's code range (:func:`_code_bounds`), the kind of dtype, and an fp8 dtype's largest finite value,
    mantissa bits and smallest normal exponent."""
    fp8 = (info.max_finite, *fp8_format(dtype)) if info.kind == "fp8" else (0.0, 0, 0)
    return (*_code_bounds(info.qmin, info.qmax), info.kind, fp8)


def candidate_error(x: torch.Tensor, scale: torch.Tensor, inv_scale: torch.Tensor, zero_point: torch.Tensor,
                    qmin: torch.Tensor, qmax: torch.Tensor, kind: str, fp8: tuple[float, int, int],
                    norm: float) -> torch.Tensor:
    """``Σ_k |x − x̂|ⁿ`` ``[C, R]`` of rows ``x[R, K]`` under candidate qparams ``scale``/``zero_point``
    ``[C, R]`` (float32; ``inv_scale = 1 / scale``; zero points only for integer dtypes) for a ``kind``
    of dtype (its other arguments from :func:`error_args`): the mse observer's inner loop, compiled in
    its search step into one fused pass per candidate with no ``[C, R, K]`` temporary, for integer, nf4
    (its pair of levels by 7 comparisons, its level as midpoint ± half gap, no gather) and fp8 dtypes.
    The same formulas as the eager ``observers._fake_quant_error``, in the code domain
    (``x − x̂ = s·(t − q(t))``) and with ``t = x · (1/s)`` for ``x / s``: a multiply per element and
    candidate instead of a divide (23 % faster here). It estimates the error of each candidate (within
    ~1e-6 relative), it does not make codes: those come from ``quantize``, which divides."""
    if kind == "nf4":
        return _fake_quant_error_nf4(x, scale, inv_scale, NF4_MIDPOINTS, NF4_MIDPOINT_BITS, NF4_HALF_GAP_BITS, norm)
    if kind == "fp8":
        return _fake_quant_error_fp8(x, scale, inv_scale, *fp8, norm)
    return _fake_quant_error_int(x, scale, inv_scale, zero_point, qmin, qmax, norm)


def _decode(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    return (codes.float() - zero_point) * scale


def decode(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor | None:
    """``(codes − zero_point) · scale`` in float32 (integer and fp8 codes ``[B, K]``; scale and zero point
    float32 columns ``[B, 1]``, zeros when symmetric): the eager ``dequantize`` formula, fused."""
    return KERNELS.call("decode", _decode, (codes.dtype,), codes, scale, zero_point)


def _nf4_level(codes: torch.Tensor) -> torch.Tensor:
    """The float32 nf4 level of each code (0…15), ``NF4_LEVELS[codes]`` by a tree of selects on the code's
    4 bits, taken by comparisons in float32: vector code where a gather from the 16 levels is not (decoding
    and summing 16M codes in isolation: ~3x faster; dequantizing a 4096² nf4 weight, 31 → 23–26 ms; bits
    taken by integer ``&`` instead vectorised worse still)."""
    f = codes.float()
    bits = []
    for weight in (8.0, 4.0, 2.0, 1.0):
        bit = f >= weight
        bits.append(bit)
        f = f - torch.where(bit, weight, 0.0)
    return cast(torch.Tensor, _select(bits, list(NF4_LEVELS)))  # four bits: a tensor, not a constant


def _decode_nf4(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _nf4_level(codes) * scale


def decode_nf4(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """``NF4_LEVELS[codes] · scale`` in float32 (nf4 indices ``[B, K]``, scale ``[B, 1]``)."""
    return KERNELS.call("decode_nf4", _decode_nf4, (), codes, scale)


def _pack_codes(codes: torch.Tensor, qmin: int, bits: int) -> torch.Tensor:
    off = (codes - qmin).to(torch.uint8)  # codes are in [qmin, qmin + 2**bits): no wrap-around
    if 8 % bits == 0:  # whole offsets per byte, the first in the low bits (uint8 ops vectorise best)
        lanes = off.reshape(-1, 8 // bits)
        byte = lanes[:, 0]
        for j in range(1, 8 // bits):
            byte = byte | (lanes[:, j] << (j * bits))
        return byte
    # Otherwise eight offsets are 8·bits bits: exactly ``bits`` bytes of the little-endian stream.
    eights = off.reshape(-1, 8).to(torch.int64)
    word = eights[:, 0]
    for j in range(1, 8):
        word = word | (eights[:, j] << (j * bits))
    return torch.stack([(word >> (8 * k)) & 255 for k in range(bits)], dim=1).to(torch.uint8).reshape(-1)


def pack_codes(codes: torch.Tensor, qmin: int, bits: int) -> torch.Tensor | None:
    """The packed bitstream (CONTRACT §5) of the offsets ``codes − qmin``, ``codes`` flat with a multiple of
    8 elements, each in ``[qmin, qmin + 2**bits)``: one pass from the codes to the bytes, with no offsets
    tensor in between. The same bytes as ``packing.pack``."""
    return KERNELS.call("pack", _pack_codes, (codes.dtype, qmin, bits), codes.reshape(-1), qmin, bits)


def _float64(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64; bfloat16 and float16 through float32 (exact): Inductor's direct conversion of theirs is
    not vectorised (statistics sums of a 4096² bfloat16 weight: 9.6 against 7.3 ms)."""
    return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).double()


def _moments(x: torch.Tensor, x_hat: torch.Tensor, abs_x: bool = True) -> torch.Tensor:
    a = _float64(x)
    b = _float64(x_hat)
    dims = tuple(range(1, a.dim()))  # every dim but the chunks' (reducing them as they are vectorises;
    n_c = 1  # flattening a broadcast x̂ first does not)
    for d in dims:
        n_c = n_c * a.shape[d]
    # Σ (x − mean_c)² of each chunk from sums shifted by its first element k: Σ(x − k)² − (Σ(x − k))² / n_c.
    # One pass: centring on the chunk's mean needs that mean first, a second loop over the chunk. As exact:
    # k is one of the chunk's values, so (k − mean_c)² ≤ Σ (x − mean_c)², and the subtraction cancels at most
    # log2(n_c + 1) bits (for an extreme outlier first: 18 of float64's 53 in a chunk of 2¹⁸ values; about 1 when
    # k is typical).
    k = a[(slice(None), *((slice(0, 1),) * len(dims)))]
    shifted = a - k
    sum_shifted = shifted.sum(dim=dims)
    m2 = ((shifted * shifted).sum(dim=dims) - sum_shifted * sum_shifted / n_c).clamp(min=0.0)
    sum_x = a.sum(dim=dims)
    err = (a - b).abs()
    # max |x| only when asked: a pass of its own over each chunk (Inductor does not fuse it with the
    # error sums, whose loops follow x̂'s broadcast), and a latency-bound one (a NaN-propagating max)
    max_abs_x = a.abs().amax(dim=dims) if abs_x else torch.full_like(sum_x, math.nan)
    return torch.stack([
        torch.full_like(sum_x, n_c), sum_x, m2, (a * a).sum(dim=dims),
        (b * b).sum(dim=dims), (a * b).sum(dim=dims), (err * err).sum(dim=dims), err.sum(dim=dims),
        err.amax(dim=dims), max_abs_x,
    ], dim=1)


def moments(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor | None:
    """Per row of ``x``/``x_hat`` ``[n, chunk]`` the float64 sums of ``stats._chunk_sums`` (same order
    of columns), ``[n, 10]``, in one pass over both."""
    return KERNELS.call("moments", _moments, (x.dtype, x_hat.dtype), x, x_hat)


def _moments_from_codes(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                        codebook: torch.Tensor, nf4: bool) -> torch.Tensor:
    # x̂ in float64: a code (or a float32 nf4 level) times a float32 scale is exact there (≤ 48 bits). nf4 levels
    # by a gather here: _nf4_level's selects made this kernel 5x slower (its loops over [n, rows, K] then
    # did not vectorise), where they make decode_nf4 faster.
    if nf4:
        x_hat = codebook[codes.long()].double() * scale.double()
    else:
        x_hat = (codes.double() - zero_point.double()) * scale.double()
    # x + 0·s is x exactly (scales are finite: choose_qparams clamps them; only a −0 becomes +0), but indexed by
    # block row like x̂: so Inductor reduces x's own sums in the loop of the error sums. Otherwise it merges x's
    # rows and columns into a loop of its own, a second read of x: 5.1 against 5.9 ms for a 4096² int8 weight's
    # sums. (0·zero point, the same value, made the nf4 kernel 4x slower: its loops were then not vectorised.)
    return _moments(_float64(x) + scale.double() * 0.0, x_hat, abs_x=False)


def moments_from_codes(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                       codebook: torch.Tensor, *, nf4: bool) -> torch.Tensor | None:
    """:func:`moments` of ``x`` against its codes dequantized exactly (in float64) on the fly, never stored: ``x`` and
    ``codes`` ``[n, rows, K]``, scale and zero point ``[n, rows, 1]``; one row of sums per chunk ``n``. Its max
    ``|x|`` column is NaN: only float casts' statistics use it, and their ``x̂`` is not made from codes."""
    return KERNELS.call("moments_codes", _moments_from_codes, (x.dtype, codes.dtype, nf4),
                        x, codes, scale, zero_point, codebook, nf4)


def _outliers(x: torch.Tensor, mean: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    return ((_float64(x) - mean).abs() > threshold).sum()


def _outside(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return ((xf < lo) | (xf > hi)).sum()


# Steps of one float32 ulp tried from the rounded bound before giving up on float32 bounds (they are found within 1).
_BOUND_STEPS = 8


def _float32_interval(mean: float, threshold: float) -> tuple[float, float] | None:
    """The float32 values ``lo ≤ hi`` with ``|v − mean| ≤ threshold`` (in float64, as the outlier count computes it)
    exactly for the float32 ``v`` in ``[lo, hi]``; None when there are none, or they were not found within
    :data:`_BOUND_STEPS` ulps of ``mean ∓ threshold`` rounded to float32 (then the count stays in float64).
    ``v − mean`` rounded to float64 is monotone in ``v``, so these ``v`` are an interval; its ends are that
    near but for means far beyond the threshold and float32's range (e.g. ±1e39), which fall back."""
    import numpy as np

    top = float(np.finfo(np.float32).max)

    def inside(v: np.float32) -> bool:
        return abs(float(v) - mean) <= threshold

    def end(start: float, outward: float) -> float | None:
        v = np.float32(min(max(start, -top), top))
        toward_mean = np.float32(-outward)
        for _ in range(_BOUND_STEPS):
            if inside(v):
                beyond = np.nextafter(v, np.float32(outward))
                if not inside(beyond) or not math.isfinite(float(beyond)):
                    return float(v)
                v = beyond
            else:
                v = np.nextafter(v, toward_mean)
        return None

    if not (math.isfinite(mean) and math.isfinite(threshold)):
        return None
    with np.errstate(over="ignore"):  # stepping past float32's largest value gives inf: that end is then found
        hi, lo = end(mean + threshold, math.inf), end(mean - threshold, -math.inf)
    return None if hi is None or lo is None or lo > hi else (lo, hi)


def outlier_count(x: torch.Tensor, mean: float, threshold: float) -> torch.Tensor | None:
    """``#{|x − mean| > threshold}`` computed in float64 (a 0-d int64 tensor). For float32, bfloat16 and float16
    ``x`` the same count by two float32 comparisons against the ends of the interval that is not outlying
    (:func:`_float32_interval`): no float64 per element (bfloat16 weights 4.6–4.8 → 0.9–1.0 ms for 4096², float32
    7 %)."""
    flat = x.reshape(-1)
    bounds = _float32_interval(mean, threshold) if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else None
    if bounds is not None:
        lo, hi = (torch.tensor(b, dtype=torch.float32) for b in bounds)
        return KERNELS.call("outside", _outside, (x.dtype,), flat, lo, hi)
    m = torch.tensor(mean, dtype=torch.float64)
    t = torch.tensor(threshold, dtype=torch.float64)
    return KERNELS.call("outliers", _outliers, (x.dtype,), flat, m, t)
