"""Error statistics of a quantized tensor (CONTRACT §4, ``quantd_client.ErrorStats``).

Sums are accumulated in float64 over chunks, so memory stays bounded and precision does not depend on
the tensor's size: one pass over ``x`` and ``x_hat`` for the sums (each chunk converted once into a
float64 buffer that stays in cache; sums stay on the device until one sync at the end), one more over
``x`` for the outliers (their threshold needs the global std). Mean and variance are merged per chunk
(Chan et al.) rather than taken as ``E[x²] − E[x]²``, which cancels badly when the mean is large; each
chunk's ``Σ (x − mean_c)²`` is centred on its mean (eager) or shifted by its first value (the compiled
kernels, in one pass: :func:`quantd.engine.kernels.stats._moments`).
The clipped count reads only the per-block extremes unless a block actually clips (the eager sums take them
from the chunks they already hold). On CPU the eager chunks are spread over :mod:`quantd.engine.parallel`'s
pool, each chunk's ops single-threaded.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from quantd.engine import kernels
from quantd.engine.granularity import block_view, granularity_of, is_row_major
from quantd.engine.kernels import quantize as compiled_quantize
from quantd.engine.kernels import stats as compiled
from quantd.engine.parallel import map_chunks
from quantd.engine.primitives import FLOAT_TORCH_DTYPES, NF4_CODEBOOK_F32, dequantize
from quantd.engine.types import QuantizedTensor
from quantd.errors import ConfigError
from quantd_client import ErrorStats
from quantd_client._dtypes import DTYPES, NF4_CODEBOOK

_CHUNK = 1 << 18  # float64 elements per chunk: 2 MiB
# On CUDA, eager chunks are large (each op fills the device; fewer launches), and the fused kernels' chunks
# small: each chunk's sums are one reduction of the kernel, and the device wants thousands of them at once.
_CUDA_EAGER_CHUNK = 1 << 24
_CUDA_FUSED_CHUNK = 1 << 12


@functools.lru_cache(maxsize=16)
def _codebook(device: torch.device) -> torch.Tensor:
    """The float32 nf4 levels on ``device``, copied there once (read only)."""
    return NF4_CODEBOOK_F32.to(device)


def _chunk(device: torch.device, *, fused: bool = False) -> int:
    """Elements per chunk of the statistics on ``device``: eager, or in one ``fused`` compiled kernel."""
    if device.type == "cpu":
        return _CHUNK
    return _CUDA_FUSED_CHUNK if fused else _CUDA_EAGER_CHUNK
OUTLIER_STDS = 3.0
ZERO_POINT_BITS = 8

_FP8_TOP_STEP = {  # the fp8 step between the two largest finite values: 2^(floor(log2 max) − mantissa bits)
    "fp8_e4m3": 32.0,  # 448 = 1.75·2^8, 3 mantissa bits
    "fp8_e5m2": 8192.0,  # 57344 = 1.75·2^15, 2 mantissa bits
}


def _flat_chunks(t: torch.Tensor) -> Iterator[torch.Tensor]:
    flat = t.reshape(-1)
    step = _chunk(t.device)
    for i in range(0, flat.numel(), step):
        yield flat[i:i + step]


def theoretical_sqnr_db(bits: int) -> float:
    """The textbook SQNR of a ``bits``-bit uniform quantizer, 6.02·b + 1.76 dB: that of a full-scale sine
    wave (a full-scale uniform signal gives 6.02·b dB; Gaussian-like weights, whose range is set by rare
    extremes, give several dB less)."""
    return 6.02 * bits + 1.76


def bits_per_weight(qt: QuantizedTensor) -> float:
    """Stored bits per element: codes, plus scales (in their dtype) and zero points (8 bits each)."""
    numel = max(1, math.prod(qt.shape))
    total = numel * DTYPES[qt.dtype].bits
    if qt.scale is not None:
        total += qt.scale.numel() * qt.scale.element_size() * 8
    if qt.zero_point is not None:  # integer zero points take 8 bits; float ones (HQQ) their dtype's
        bits = ZERO_POINT_BITS if qt.zero_point_domain == "int" else qt.zero_point.element_size() * 8
        total += qt.zero_point.numel() * bits
    for extra in (qt.g_idx, qt.channel_scale):  # a column order (int32), per-input-channel scales (float32)
        if extra is not None:
            total += extra.numel() * extra.element_size() * 8
    return total / numel


def theoretical_max_error(qt: QuantizedTensor, absmax: float | None) -> float:
    """Half the largest quantization step; elements not clipped never exceed it.

    Integer dtypes: max(scale)/2. nf4: half the largest codebook gap × max(scale). fp8: half the
    step at the top of the fp8 range × max(scale). float16/bfloat16: half an ulp at ``absmax`` (the
    input's largest ``|x|``, which only these need).
    """
    info = DTYPES[qt.dtype]
    if info.kind == "float":
        if absmax is None:
            raise ValueError(f"the bound of a {qt.dtype} cast needs the input's largest |x|")
        finfo = torch.finfo(FLOAT_TORCH_DTYPES[qt.dtype])
        m = min(absmax, finfo.max)
        if m == 0.0:
            return 0.0
        exponent = max(math.frexp(m)[1] - 1, math.frexp(finfo.smallest_normal)[1] - 1)
        return math.ldexp(finfo.eps, exponent) / 2
    if qt.scale is None:
        raise ConfigError(f"{qt.dtype} codes need a scale", field="scale")
    max_scale = float(qt.scale.float().max())
    if info.kind == "nf4":
        gap = max(b - a for a, b in itertools.pairwise(NF4_CODEBOOK))
        return gap / 2 * max_scale
    if info.kind == "fp8":
        return _FP8_TOP_STEP[qt.dtype] / 2 * max_scale
    if qt.channel_scale is not None:  # column j's step is its scale divided by channel_scale[j]
        max_scale /= float(qt.channel_scale.float().min())
    return max_scale / 2


def _block_bounds(qt: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block row, the interval of ``x / scale`` that is not clipped, float32 columns ``[B, 1]``: the
    representable range and the half step beyond each end, which rounds onto the end value anyway:
    ``[qmin − ½ − zp, qmax + ½ − zp]`` (integers), ``[−1 − g₀/2, 1 + g₁₄/2]`` (nf4, g the gaps at either
    end of its levels), ``±(max_finite + top step/2)`` (fp8)."""
    info = DTYPES[qt.dtype]
    if qt.scale is None:
        raise ConfigError(f"{qt.dtype} codes need a scale", field="scale")
    rows = qt.scale.numel()
    dev = qt.scale.device
    if info.kind == "int":
        zp = (torch.zeros(rows, device=dev) if qt.zero_point is None
              else qt.zero_point.reshape(-1).float())
        return (info.qmin - 0.5 - zp).unsqueeze(1), (info.qmax + 0.5 - zp).unsqueeze(1)
    if info.kind == "nf4":
        lo_v = NF4_CODEBOOK[0] - (NF4_CODEBOOK[1] - NF4_CODEBOOK[0]) / 2
        hi_v = NF4_CODEBOOK[-1] + (NF4_CODEBOOK[-1] - NF4_CODEBOOK[-2]) / 2
    else:
        hi_v = float(info.max_finite) + _FP8_TOP_STEP[qt.dtype] / 2
        lo_v = -hi_v
    return torch.full((rows, 1), lo_v, device=dev), torch.full((rows, 1), hi_v, device=dev)


def clipped_count(x: torch.Tensor, qt: QuantizedTensor, ranges: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> int:
    """Elements of ``x`` outside the range ``qt`` represents (the clamp moved them by more than
    half a step): integer ``x/scale + zp ∉ [qmin − ½, qmax + ½]``; nf4 ``x/scale`` beyond its end levels
    ±1 by more than half the gap next to them; fp8 ``|x/scale| > max_finite + top step/2``; float casts
    ``|x| > max_finite``. The same rule for every dtype: an element not clipped is within half a step of
    its value, so its error stays within ``theoretical_max_error``.

    Division by a positive scale is monotone (also after float32 rounding), so a block whose own
    ``min/scale`` and ``max/scale`` are inside the bounds has no clipped element: only the blocks that
    fail this check are counted element by element (none, for min-max ranges). ``ranges``: each block's
    min and max of ``x`` in float32 when already known (the statistics' chunk loop takes them on the way),
    else they are computed here.
    """
    info = DTYPES[qt.dtype]
    if info.kind == "float":
        limit = torch.finfo(FLOAT_TORCH_DTYPES[qt.dtype]).max  # compared in float64: in bfloat16, float16's
        return int(sum((part.double().abs() > limit).sum() for part in _flat_chunks(x)))  # 65504 is 65536
    blocks, _ = block_view(x, granularity_of(qt), name="x")
    lo_b, hi_b = _block_bounds(qt)
    scale = qt.scale.reshape(-1, 1).float()  # type: ignore[union-attr]  # _block_bounds checked it
    rng = ranges
    if rng is None and kernels.KERNELS.wants(blocks):
        rng = compiled_quantize.row_range(blocks)
    lo_r, hi_r = rng if rng is not None else (blocks.amin(dim=1), blocks.amax(dim=1))
    lo_x = lo_r.unsqueeze(1).float() / scale
    hi_x = hi_r.unsqueeze(1).float() / scale
    suspect = ((lo_x < lo_b) | (hi_x > hi_b)).reshape(-1).nonzero().reshape(-1)
    if suspect.numel() == 0:
        return 0
    count = torch.zeros((), dtype=torch.int64, device=x.device)
    rows_per_chunk = max(1, _chunk(x.device) // blocks.shape[1])
    for r in range(0, suspect.numel(), rows_per_chunk):
        idx = suspect[r:r + rows_per_chunk]
        q = blocks.index_select(0, idx).float() / scale[idx]
        count += (q < lo_b[idx]).sum() + (q > hi_b[idx]).sum()
    return int(count)


# Per chunk sums, in this order (float64, one row per chunk).
_N, _SUM_X, _M2, _SUM_X2, _SUM_H2, _SUM_XH, _SUM_E2, _SUM_ABS_E, _MAX_ABS_E, _MAX_ABS_X = range(10)


@dataclass
class _Moments:
    """Float64 sums over ``x`` and ``x_hat`` (merged over chunks)."""

    n: int
    mean: float
    m2: float  # Σ (x − mean)²
    sum_x2: float
    sum_h2: float
    sum_xh: float
    sum_e2: float
    sum_abs_e: float
    max_abs_e: float
    max_abs_x: float | None  # None from the compiled codes path (only float casts use it)
    block_ranges: tuple[torch.Tensor, torch.Tensor] | None = None  # each block's float32 min and max of x


def _chunk_sums(xc: torch.Tensor, hc: torch.Tensor) -> torch.Tensor:
    """The per-chunk sums of float ``xc``/``hc``, through float64 buffers of the chunk's size.

    One conversion of each input, then in-cache float64 passes; results stay on the device (no sync).
    """
    a = torch.empty(xc.numel(), dtype=torch.float64, device=xc.device)
    b = torch.empty_like(a)
    a.copy_(xc)
    b.copy_(hc)
    return _buffer_sums(a, b)


def _buffer_sums(a: torch.Tensor, b: torch.Tensor, *, abs_x: bool = True) -> torch.Tensor:
    """The sums of :func:`_chunk_sums` of the float64 chunks ``a`` (x) and ``b`` (x̂), both overwritten.
    ``abs_x=False`` leaves out max ``|x|`` (NaN in its column): only float casts' statistics use it."""
    n_c = a.numel()
    sum_x = a.sum()
    sum_x2, sum_h2, sum_xh = torch.dot(a, a), torch.dot(b, b), torch.dot(a, b)
    if abs_x:  # (vector_norm(inf) is many times slower on CPU)
        max_abs_x = torch.maximum(a.amax(), a.amin().neg())
    else:
        max_abs_x = torch.full((), math.nan, dtype=torch.float64, device=a.device)
    err = b.sub_(a).abs_()  # |x − x̂|
    sum_e2 = torch.dot(err, err)
    sum_abs_e = err.sum()
    max_abs_e = err.amax()
    centred = a.sub_(sum_x / n_c)  # Σ (x − mean_c)²: exact per chunk, merged by Chan et al. below
    m2 = torch.dot(centred, centred)
    n_t = torch.tensor(float(n_c), dtype=torch.float64, device=a.device)
    return torch.stack([n_t, sum_x, m2, sum_x2, sum_h2, sum_xh, sum_e2, sum_abs_e, max_abs_e, max_abs_x])


def moments(x: torch.Tensor, x_hat: torch.Tensor) -> _Moments:
    """All sums in one pass over ``x`` and ``x_hat`` and one host sync at the end.

    Chunks' means and centred sums merge as ``M2 = Σ m2_c + Σ n_c (mean_c − mean)²`` (the parallel
    form of Chan et al.), which never subtracts two large sums.
    """
    fx, fh = x.reshape(-1), x_hat.reshape(-1)
    step = min(_chunk(x.device), fx.numel())
    rows: list[torch.Tensor] = []
    start = 0
    if kernels.KERNELS.wants(fx):  # the whole chunks in one fused pass, the tail below
        width = _chunk(x.device, fused=True)
        whole = fx.numel() // width * width
        fused = compiled.moments(fx[:whole].view(-1, width), fh[:whole].view(-1, width))
        if fused is not None:
            rows.append(fused)
            start = whole
    if start < fx.numel():
        starts = range(start, fx.numel(), step)
        rows.append(torch.stack(map_chunks(lambda i: _chunk_sums(fx[starts[i]:starts[i] + step],
                                                                 fh[starts[i]:starts[i] + step]),
                                           len(starts), x.device)))
    return _merge(torch.cat(rows))


def _merge(s: torch.Tensor) -> _Moments:
    """The per-chunk sums ``[chunks, 10]`` merged (one host sync)."""
    n = s[:, _N].sum()
    mean = s[:, _SUM_X].sum() / n
    m2 = s[:, _M2].sum() + (s[:, _N] * (s[:, _SUM_X] / s[:, _N] - mean) ** 2).sum()
    tot = s.sum(dim=0).tolist()
    mx = s.amax(dim=0).tolist()
    return _Moments(n=int(tot[_N]), mean=float(mean), m2=float(m2), sum_x2=tot[_SUM_X2], sum_h2=tot[_SUM_H2],
                    sum_xh=tot[_SUM_XH], sum_e2=tot[_SUM_E2], sum_abs_e=tot[_SUM_ABS_E],
                    max_abs_e=mx[_MAX_ABS_E], max_abs_x=None if math.isnan(mx[_MAX_ABS_X]) else mx[_MAX_ABS_X])


def outlier_count(x: torch.Tensor, mean: float, threshold: float) -> int:
    """``#{|x − mean| > threshold}`` in float64, chunked, one host sync. For float32, bfloat16 and float16
    ``x`` the same count by two float32 comparisons against the ends of the interval that is not outlying
    (``kernels.stats._float32_interval``), with no float64 copy."""
    flat = x.reshape(-1)
    if kernels.KERNELS.wants(flat):
        fused = compiled.outlier_count(flat, mean, threshold)
        if fused is not None:
            return int(fused)
    step = min(_chunk(x.device), flat.numel())
    starts = range(0, flat.numel(), step)
    bounds = (compiled._float32_interval(mean, threshold)
              if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else None)
    if bounds is not None:
        lo, hi = bounds

        def outside(i: int) -> torch.Tensor:
            # Comparisons into float32 0/1 and their float32 sum: exact (a chunk's count is at most 2²⁴), and
            # several times faster on CPU than a bool result and its integer sum.
            part = flat[starts[i]:starts[i] + step].float()
            flags = torch.empty_like(part)
            return (torch.lt(part, lo, out=flags).sum() + torch.gt(part, hi, out=flags).sum()).to(torch.int64)

        return int(torch.stack(map_chunks(outside, len(starts), x.device)).sum())

    def above(i: int) -> torch.Tensor:
        d = flat[starts[i]:starts[i] + step].to(torch.float64, copy=True)
        return (d.sub_(mean).abs_() > threshold).sum(dtype=torch.int32)  # a chunk has < 2**31 elements

    return int(torch.stack(map_chunks(above, len(starts), x.device)).sum())


def _cosine(m: _Moments) -> float:
    if m.sum_x2 == 0.0 and m.sum_h2 == 0.0:
        return 1.0
    if m.sum_x2 == 0.0 or m.sum_h2 == 0.0:
        return 0.0
    return max(-1.0, min(1.0, m.sum_xh / math.sqrt(m.sum_x2 * m.sum_h2)))


def _chunk_rows(blocks: int, width: int, device: torch.device) -> int:
    """Block rows per chunk of the fused statistics: the largest divisor of ``blocks`` with at most
    ``_chunk(device, fused=True)`` elements per chunk (at least one row)."""
    limit = max(1, min(blocks, _chunk(device, fused=True) // max(1, width)))
    return next(r for r in range(limit, 0, -1) if blocks % r == 0)


def _moments_from_codes(x: torch.Tensor, qt: QuantizedTensor) -> _Moments | None:
    """The sums of :func:`moments` against ``dequantize(qt, dtype=float64)`` without materialising it:
    each chunk's ``x̂`` is decoded with dequantize's float64 formula in registers by the fused kernel, or
    eager into a cache-sized buffer. None when the codes' blocks are not row-major (the caller
    dequantizes)."""
    info = DTYPES[qt.dtype]
    gran = granularity_of(qt)
    if (info.kind == "float" or qt.scale is None
            or qt.g_idx is not None or qt.channel_scale is not None
            or not (is_row_major(x, gran) and is_row_major(qt.codes, gran))):
        return None
    if not kernels.KERNELS.wants(x):
        return _moments_from_codes_eager(x, qt)
    blocks, _ = block_view(x, gran, name="x")
    codes, _ = block_view(qt.codes, gran, name="codes")
    scale = qt.scale.reshape(-1, 1).float()
    zp = torch.zeros_like(scale) if qt.zero_point is None else qt.zero_point.reshape(-1, 1).float()
    n_blocks, width = blocks.shape
    chunk = _chunk(x.device, fused=True)
    if n_blocks == 1 and width % chunk == 0:  # one scale for all: chunks of `chunk` elements
        shape3 = (width // chunk, 1, chunk)
        scale3, zp3 = scale.reshape(1, 1, 1).expand(shape3[0], 1, 1), zp.reshape(1, 1, 1).expand(shape3[0], 1, 1)
    else:
        rows = _chunk_rows(n_blocks, width, x.device)
        shape3 = (n_blocks // rows, rows, width)
        scale3, zp3 = scale.reshape(shape3[0], rows, 1), zp.reshape(shape3[0], rows, 1)
    fused = compiled.moments_from_codes(blocks.reshape(shape3), codes.reshape(shape3), scale3, zp3, _codebook(x.device),
                                       nf4=info.kind == "nf4")
    return None if fused is None else _merge(fused)


def _moments_from_codes_eager(x: torch.Tensor, qt: QuantizedTensor) -> _Moments:
    """:func:`_moments_from_codes` in eager torch: chunks of whole block rows (at most ``_chunk`` elements
    unless one row is longer, then pieces of it), each decoded into a float64 buffer, never the whole
    float64 ``x̂``."""
    info = DTYPES[qt.dtype]
    gran = granularity_of(qt)
    blocks, _ = block_view(x, gran, name="x")
    codes, _ = block_view(qt.codes, gran, name="codes")
    assert qt.scale is not None  # (checked by the caller)
    scale = qt.scale.reshape(-1, 1).double()
    zp = None if qt.zero_point is None else qt.zero_point.reshape(-1, 1).double()
    codebook = NF4_CODEBOOK_F32.to(device=x.device, dtype=torch.float64) if info.kind == "nf4" else None
    n_blocks, width = blocks.shape
    chunk = _chunk(x.device)
    rows = max(1, min(n_blocks, chunk // max(1, width)))
    cols = min(width, chunk)
    pieces = [(r, c) for r in range(0, n_blocks, rows) for c in range(0, width, cols)]
    # Chunks of whole block rows also give each block's extremes, from the chunk in cache: the clipped count
    # then needs no pass of its own over x.
    lo_all = hi_all = None
    if cols == width:
        lo_all = torch.empty(n_blocks, dtype=torch.float32, device=x.device)
        hi_all = torch.empty_like(lo_all)

    def sums(i: int) -> torch.Tensor:
        r, c = pieces[i]
        xb, cb = blocks[r:r + rows, c:c + cols], codes[r:r + rows, c:c + cols]
        a = torch.empty(xb.shape, dtype=torch.float64, device=x.device)
        b = torch.empty_like(a)
        a.copy_(xb)
        if lo_all is not None and hi_all is not None:  # exact: x in float64, its extremes back in float32
            lo_all[r:r + rows] = a.amin(dim=1)
            hi_all[r:r + rows] = a.amax(dim=1)
        if codebook is not None:
            torch.index_select(codebook, 0, cb.reshape(-1).long(), out=b.view(-1))
        else:
            b.copy_(cb)
            if zp is not None:
                b.sub_(zp[r:r + rows])
        b.mul_(scale[r:r + rows])
        return _buffer_sums(a.view(-1), b.view(-1), abs_x=False)

    m = _merge(torch.stack(map_chunks(sums, len(pieces), x.device)))
    return m if lo_all is None or hi_all is None else replace(m, block_ranges=(lo_all, hi_all))


def quantized_error_stats(x: torch.Tensor, qt: QuantizedTensor) -> ErrorStats:
    """``error_stats(x, dequantize(qt, dtype=float64), qt)``: the error of the quantization itself, with
    ``x̂`` exact (float64), so that no element that is not clipped exceeds ``theoretical_max_error``
    (float32's ``c · s`` may round past ``s/2``; with float32 scales it did on a third of random
    symmetric tensors). On the fused CPU path ``x̂`` is decoded on the fly (one pass over ``x`` and the
    codes), else through ``dequantize``."""
    _check_shapes(x, x, qt)
    m = _moments_from_codes(x, qt)
    if m is None:
        return error_stats(x, dequantize(qt, dtype=torch.float64), qt)
    return _stats(x, qt, m)


def _in_code_order(x: torch.Tensor, qt: QuantizedTensor) -> tuple[torch.Tensor, QuantizedTensor]:
    """``x`` and ``qt`` as plain contiguous groups: columns multiplied by ``channel_scale`` (the values the
    codes round) and sorted by ``g_idx`` (each group's columns side by side), neither left on ``qt``."""
    if qt.g_idx is None and qt.channel_scale is None:
        return x, qt
    rows = qt.shape[0]
    v, codes = x.reshape(rows, -1), qt.codes.reshape(rows, -1)
    if qt.channel_scale is not None:
        v = v * qt.channel_scale.to(device=v.device, dtype=v.dtype)
    if qt.g_idx is not None:
        order = torch.argsort(qt.g_idx.to(v.device), stable=True)
        v, codes = v[:, order], codes[:, order]
    return v.reshape(qt.shape), replace(qt, codes=codes.reshape(qt.shape), g_idx=None, channel_scale=None)


def _check_shapes(x: torch.Tensor, x_hat: torch.Tensor, qt: QuantizedTensor) -> None:
    if tuple(x.shape) != tuple(x_hat.shape) or tuple(x.shape) != tuple(qt.shape):
        raise ConfigError(f"x {list(x.shape)}, x_hat {list(x_hat.shape)} and the quantized tensor "
                          f"{list(qt.shape)} must have one shape", field="x_hat")
    if x.numel() == 0:
        raise ConfigError("statistics of an empty tensor are undefined", field="shape")


def error_stats(x: torch.Tensor, x_hat: torch.Tensor, qt: QuantizedTensor) -> ErrorStats:
    """CONTRACT §4 statistics of ``x_hat`` (the dequantized ``qt``) against the original ``x``."""
    _check_shapes(x, x_hat, qt)
    return _stats(x, qt, moments(x, x_hat))


def _stats(x: torch.Tensor, qt: QuantizedTensor, m: _Moments) -> ErrorStats:
    numel = x.numel()
    std = math.sqrt(m.m2 / numel)
    threshold = OUTLIER_STDS * std
    outliers = outlier_count(x, m.mean, threshold)
    mse = m.sum_e2 / numel
    signal = m.sum_x2 / numel
    if mse == 0.0:
        sqnr: float | None = None
    elif signal == 0.0:
        sqnr = -math.inf
    else:
        sqnr = 10.0 * math.log10(signal / mse)
    bpw = bits_per_weight(qt)
    info = DTYPES[qt.dtype]
    return ErrorStats(
        numel=numel,
        mse=mse,
        mae=m.sum_abs_e / numel,
        max_abs_error=m.max_abs_e,
        sqnr_db=sqnr,
        cosine=_cosine(m),
        outlier_rate=outliers / numel,
        outlier_threshold=threshold,
        clipped_fraction=clipped_count(*_in_code_order(x, qt), ranges=m.block_ranges) / numel,
        theoretical_max_error=theoretical_max_error(qt, m.max_abs_x),
        bits_per_weight=bpw,
        compression_ratio=torch.finfo(qt.orig_dtype).bits / bpw,
        theoretical_sqnr_db=theoretical_sqnr_db(info.bits) if info.kind == "int" else None,
    )
