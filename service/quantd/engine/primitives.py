"""quantize / dequantize: the engine's verbs over the block view of :mod:`quantd.engine.granularity`.

Integer dtypes: ``code = clamp(round(x / scale) + zero_point, qmin, qmax)``, ``x̂ = (code − zero_point) · scale``
(round half to even). nf4: ``code = argmin_i |x / scale − codebook[i]|``, ``x̂ = codebook[code] · scale``.
fp8: ``code = fp8(clamp(x / scale, ±max_finite))``, ``x̂ = code · scale``. float16/bfloat16: a saturating
cast (values beyond the largest finite value become ±max, never inf). Inputs are taken as float32.

Speed: tensors of at least ``kernels.MIN_ELEMENTS`` elements (``kernels.SMALL_MIN_ELEMENTS`` for
min-max integer and nf4 schemes) go through fused compiled kernels, on CPU and (with Triton) on CUDA
(:mod:`quantd.engine.kernels.quantize`: the per-block range in one pass, the qparams of all blocks in one more
over ``[B]``, the encode in one more; for min-max integer and nf4 schemes all three in one compiled call), which
compute exactly the formulas above. Otherwise (small tensors, no C++ compiler for CPU tensors, no Triton or
no way to make it keep eager CUDA's arithmetic for CUDA ones: ``kernels.cuda_options``) the eager path
below runs: the blocks are processed in chunks of rows small enough to stay in cache across the passes (on
CUDA, chunks of up to ``CUDA_CHUNK_ELEMENTS``),
with in-place ops into one preallocated buffer. For the minmax observer the range of each chunk is
observed right before it is encoded, so the input is read from memory once. Integer codes take two
passes after observing plus one store (three when affine): ``y = (x / scale + M) + zero_point`` with
``M = 1.5·2²³`` rounds ``x / scale`` half to even in the float adder itself (every float32 in ``[2²³, 2²⁴)`` is an
integer), so ``y``'s bit pattern is ``0x4B400000 + code`` and its low byte IS the int8/uint8 code: one
integer copy stores it. The clamp to ``[qmin, qmax]`` is skipped when the chunk cannot need it:
``x ↦ fl(fl(x / s) + M) + zero_point`` is monotone, so each row's extremes decide (checked on ``[rows]`` values;
on CUDA the clamp always runs, to avoid a host sync per chunk). The chunked path computes exactly
what the plain formulas above compute (tests compare them bit for bit).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from quantd.engine import kernels
from quantd.engine.granularity import (
    block_view,
    check_applicable,
    granularity_of,
    unblock,
)
from quantd.engine.kernels import quantize as compiled
from quantd.engine.observers import observe_range
from quantd.engine.parallel import map_chunks
from quantd.engine.qparams import choose_qparams, code_dtype, exact_scale, scale_torch_dtype, zero_point_dtype
from quantd.engine.types import QuantizedTensor
from quantd.errors import ConfigError, NonFiniteError
from quantd_client import Scheme
from quantd_client._dtypes import DTypeInfo, dtype_info

# 4 MiB of float32 per chunk: split over two cores it stays in their L2 (2 MiB each), on one core in
# L3, across all its passes; larger chunks fall out of cache, smaller ones pay more per-chunk overhead.
CHUNK_ELEMENTS = 1 << 20
# CUDA kernels take blocks up to this length (groups) with the length fixed at compile time; longer ones
# (channels) with any length.
CUDA_STATIC_BLOCK = 1024
# On CUDA there is no cache to stay in, and each op fills the device: chunks as large as a temporary may be
# (64 MiB of float32), for the fewest launches.
CUDA_CHUNK_ELEMENTS = 1 << 24

# float32 x + 1.5·2²³ rounds x (|x| < 2²²) to an integer, half to even, leaving it in the low mantissa bits.
_ROUND_MAGIC = 12582912.0

FLOAT_TORCH_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16}

Range = tuple[torch.Tensor, torch.Tensor]

# The nf4 levels in float32 (on the host: the compiled CPU kernels take it as an input), and the midpoints
# between consecutive levels, computed in float32 (host constants).
NF4_CODEBOOK_F32 = torch.tensor(compiled.NF4_LEVELS, dtype=torch.float32)
NF4_MIDPOINTS: tuple[float, ...] = compiled.NF4_MIDPOINTS


def _chunk_elements(device: torch.device) -> int:
    return CHUNK_ELEMENTS if device.type == "cpu" else CUDA_CHUNK_ELEMENTS


def _chunks(rows: int, cols: int, device: torch.device) -> Iterator[tuple[slice, slice]]:
    """Row chunks of about :func:`_chunk_elements` on ``device``; a row longer than that is cut into column
    chunks."""
    limit = _chunk_elements(device)
    if cols <= limit:
        step = max(1, limit // cols)
        for r in range(0, rows, step):
            yield slice(r, min(r + step, rows)), slice(0, cols)
    else:
        for r in range(rows):
            for c in range(0, cols, limit):
                yield slice(r, r + 1), slice(c, min(c + limit, cols))


class _Encoder:
    """Encodes chunks of blocks into preallocated codes, each chunk through a float32 buffer of its own (chunks
    may be encoded by several threads at once, :func:`quantd.engine.parallel.map_chunks`)."""

    def __init__(self, info: DTypeInfo, blocks: torch.Tensor, codes_dtype: torch.dtype) -> None:
        self.info = info
        self.blocks = blocks
        self.codes = torch.empty(blocks.shape, dtype=codes_dtype, device=blocks.device)
        self.mids = NF4_MIDPOINTS
        self.magic = torch.full((1, 1), _ROUND_MAGIC, dtype=torch.float32, device=blocks.device)
        self.always_clamp = blocks.device.type != "cpu"  # a host sync per chunk costs more there

    def load(self, rs: slice, cs: slice) -> torch.Tensor:
        """The chunk as float32: a view of the input, or converted into a buffer."""
        src = self.blocks[rs, cs]
        return src if src.dtype == torch.float32 else src.float()

    def encode(self, src: torch.Tensor, rs: slice, cs: slice, scale: torch.Tensor,
               zero_point: torch.Tensor | None, extremes: Range | None = None) -> None:
        """codes[rs, cs] from float32 ``src`` and per-row float32 ``scale``/``zero_point`` columns.

        ``extremes``: the rows' exact min/max of ``src`` when known; then the integer clamp runs only
        if one of them falls outside ``[qmin, qmax]``."""
        info, out = self.info, self.codes[rs, cs]
        # a chunk converted by load() is overwritten in place; a view of the input is not
        buf = torch.empty_like(src) if self.blocks.dtype == torch.float32 else src
        if info.kind == "int":
            torch.div(src, scale, out=buf)
            buf.add_(self.magic)  # rounds half to even (see the module docstring)
            if zero_point is not None:
                # A separate, exact integer add: folding zero_point into the magic constant would round
                # ties of x / scale + zero_point, not of x / scale (different when zero_point is odd).
                buf.add_(zero_point)
            if self._needs_clamp(zero_point, scale, extremes):
                buf.clamp_(_ROUND_MAGIC + info.qmin, _ROUND_MAGIC + info.qmax)
            out.copy_(buf.view(torch.int32))  # the low byte of the bit pattern is the code
            return
        torch.div(src, scale, out=buf)
        if info.kind == "nf4":
            # index = #{midpoints < v}: a value exactly between two levels goes to the lower one.
            # 15 compare-and-add passes in cache beat torch.bucketize's per-element search on CPU; counted
            # in float32 (exact: at most 15), where comparisons and adds vectorise better than bool and uint8.
            count = torch.gt(buf, self.mids[0])
            count = count.float() if count.dtype != torch.float32 else count
            above = torch.empty_like(count)
            for mid in self.mids[1:]:
                count.add_(torch.gt(buf, mid, out=above))
            out.copy_(count)
        else:
            buf.clamp_(-info.max_finite, info.max_finite)
            out.copy_(buf)


    def _needs_clamp(self, zero_point: torch.Tensor | None, scale: torch.Tensor, extremes: Range | None) -> bool:
        if extremes is None or self.always_clamp:
            return True
        lo, hi = extremes
        y_lo = lo.unsqueeze(1) / scale + self.magic  # the same float ops as on every element
        y_hi = hi.unsqueeze(1) / scale + self.magic
        if zero_point is not None:
            y_lo, y_hi = y_lo + zero_point, y_hi + zero_point
        return bool((y_lo < _ROUND_MAGIC + self.info.qmin).any() | (y_hi > _ROUND_MAGIC + self.info.qmax).any())


def _range_per_block(rng: Range, nblocks: int, *, name: str, device: torch.device) -> Range:
    """``rng`` as two float32 ``[nblocks]`` vectors on ``device`` (the weights'); a ConfigError when it has
    another size."""
    lo, hi = rng
    if lo.numel() != nblocks or hi.numel() != nblocks:
        raise ConfigError(f"observer_range has {lo.numel()}/{hi.numel()} values; the scheme needs one per "
                          f"block ({nblocks})", tensor=name, field="observer_range")
    return lo.reshape(nblocks).to(device=device, dtype=torch.float32), hi.reshape(nblocks).to(device=device,
                                                                                              dtype=torch.float32)


def _non_finite_range(name: str) -> NonFiniteError:
    return NonFiniteError("the observed range is not finite (NaN or Inf in the weights?)", tensor=name)


def _check_range(rng: Range, nblocks: int, *, name: str, device: torch.device) -> Range:
    lo, hi = _range_per_block(rng, nblocks, name=name, device=device)
    if not bool(torch.isfinite(lo).all() & torch.isfinite(hi).all()):
        raise _non_finite_range(name)
    return lo, hi


def _quantize_fused_minmax(enc: _Encoder, scheme: Scheme, *, name: str
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One read of the input: per chunk of whole rows, observe, choose qparams, encode."""
    rows, cols = enc.blocks.shape
    dev = enc.blocks.device
    scale = torch.empty(rows, dtype=scale_torch_dtype(scheme.scale_dtype), device=dev)
    lo_all = torch.empty(rows, dtype=torch.float32, device=dev)
    hi_all = torch.empty(rows, dtype=torch.float32, device=dev)
    info = dtype_info(scheme.dtype)
    zp = (torch.empty(rows, dtype=zero_point_dtype(scheme.dtype), device=dev)
          if info.kind == "int" and not scheme.symmetric else None)
    chunks = list(_chunks(rows, cols, dev))

    def one(i: int) -> None:
        rs, cs = chunks[i]
        src = enc.load(rs, cs)
        # The minmax observer inlined (amin/amax of the chunk's rows); its NaN/Inf check is done once
        # for all rows after the loop, not per chunk: no host sync inside the loop.
        lo, hi = torch.amin(src, dim=1, out=lo_all[rs]), torch.amax(src, dim=1, out=hi_all[rs])
        s, z = choose_qparams(lo, hi, dtype=scheme.dtype, symmetric=scheme.symmetric,
                              scale_dtype=scheme.scale_dtype)
        scale[rs] = s
        if zp is not None and z is not None:
            zp[rs] = z
        enc.encode(src, rs, cs, s.float().unsqueeze(1), None if z is None else z.float().unsqueeze(1),
                   extremes=(lo, hi))

    map_chunks(one, len(chunks), dev)
    if not bool(torch.isfinite(lo_all).all() & torch.isfinite(hi_all).all()):
        raise NonFiniteError(f"tensor {name!r} has NaN or Inf values; cannot observe a range", tensor=name)
    return enc.codes, scale, zp


def _quantize_two_pass(enc: _Encoder, scheme: Scheme, rng: Range | None, *, name: str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Observe all blocks (or take the given range), then encode chunk by chunk."""
    rows, cols = enc.blocks.shape
    if rng is None:
        rng = observe_range(enc.blocks.float(), scheme, name=name)
    elif not bool(torch.isfinite(enc.blocks).all()):
        raise NonFiniteError("NaN or Inf in the weights", tensor=name)
    lo, hi = _check_range(rng, rows, name=name, device=enc.blocks.device)
    scale, zp = choose_qparams(lo, hi, dtype=scheme.dtype, symmetric=scheme.symmetric,
                               scale_dtype=scheme.scale_dtype)
    s_col = scale.float().unsqueeze(1)
    z_col = None if zp is None else zp.float().unsqueeze(1)
    chunks = list(_chunks(rows, cols, enc.blocks.device))

    def one(i: int) -> None:
        rs, cs = chunks[i]
        enc.encode(enc.load(rs, cs), rs, cs, s_col[rs], None if z_col is None else z_col[rs])

    map_chunks(one, len(chunks), enc.blocks.device)
    return enc.codes, scale, zp


def _encode_compiled(blocks: torch.Tensor, info: DTypeInfo, codes_dtype: torch.dtype, s_col: torch.Tensor,
                     z_col: torch.Tensor) -> torch.Tensor | None:
    """All blocks encoded by one fused kernel (:mod:`quantd.engine.kernels`) from float32 scale and zero
    point columns ``[B, 1]``; None when not compiled."""
    if info.kind == "int":
        return compiled.encode_int(blocks, s_col, z_col, info.qmin, info.qmax, codes_dtype)
    if info.kind == "nf4":
        return compiled.encode_nf4(blocks, s_col, NF4_MIDPOINTS)
    return compiled.encode_fp8(blocks, s_col, info.max_finite, codes_dtype)


def _quantize_compiled(blocks: torch.Tensor, scheme: Scheme, info: DTypeInfo, codes_dtype: torch.dtype,
                       rng: Range | None, *, name: str
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, float | None] | None:
    """Observe (minmax: one fused pass), choose qparams, encode (one fused pass); codes, scale, zero point and
    the largest scale when the kernel found it (else None). None when the kernels are not available, and the
    caller takes the eager path."""
    if blocks.device.type == "cuda" and blocks.shape[1] <= CUDA_STATIC_BLOCK:
        # A group's length as a constant of the CUDA kernel: each program then reduces many whole groups held
        # in registers, where a length known only at run time gets one looped reduction per group.
        torch._dynamo.mark_static(blocks, 1)
    if rng is not None:  # given by the caller: the weights themselves are not checked by observing
        if not bool(torch.isfinite(blocks).all()):
            raise NonFiniteError("NaN or Inf in the weights", tensor=name)
    elif scheme.observer == "minmax" and info.kind in compiled.ONE_CALL_MINMAX_KINDS:  # NaN/Inf reach the ranges
        whole = compiled.quantize_minmax(blocks, info, dtype=scheme.dtype, symmetric=scheme.symmetric,
                                        scale_dtype=scheme.scale_dtype, out_dtype=codes_dtype)
        if whole is None:
            return None
        if not whole[1]:
            raise _non_finite_range(name)
        return whole[0], whole[2], whole[3], whole[4]
    elif scheme.observer == "minmax":  # NaN/Inf propagate into the range, which is checked below
        rng = compiled.row_range(blocks)
        if rng is None:
            return None
    else:
        rng = observe_range(blocks.float(), scheme, name=name)
    lo, hi = _range_per_block(rng, blocks.shape[0], name=name, device=blocks.device)
    finite, scale, zp, s_col, z_col = compiled.qparams_columns(lo, hi, dtype=scheme.dtype, symmetric=scheme.symmetric,
                                                              scale_dtype=scheme.scale_dtype)
    if not finite:
        raise _non_finite_range(name)
    codes = _encode_compiled(blocks, info, codes_dtype, s_col, z_col)
    return None if codes is None else (codes, scale, zp, None)


def _check_scales_fit(blocks: torch.Tensor, scale: torch.Tensor, scheme: Scheme, *, name: str,
                      top_scale: float | None = None) -> None:
    """A ConfigError (field ``scale_dtype``) when a block's scale needed more than the scale dtype's largest
    value (float16: 65504, e.g. int4 weights beyond ~4.9e5): its scale was clamped there and the block would
    be clipped wholesale. Only blocks whose scale sits at that largest value are looked at (their min-max
    range, an upper bound of any observer's), so this costs nothing otherwise. ``top_scale``: the largest scale,
    when the caller has it (no reduction and host sync here)."""
    top = torch.finfo(scale.dtype).max
    if scale.numel() == 0:
        return
    if (float(scale.max()) if top_scale is None else top_scale) < top:  # nonzero() only when needed
        return
    at_top = (scale.reshape(-1) >= top).nonzero().reshape(-1)
    sub = blocks.index_select(0, at_top).double()
    need = exact_scale(sub.amin(1).clamp(max=0.0), sub.amax(1).clamp(min=0.0), dtype=scheme.dtype,
                       symmetric=scheme.symmetric)
    worst = float(need.max())
    if worst > top:  # only float16 can: bfloat16 and float32 scales reach float32 weights' whole range
        raise ConfigError(f"a scale of {worst:.3g} is needed, beyond {scheme.scale_dtype}'s largest value "
                          f"{top:g}: use scale_dtype bfloat16 or float32", tensor=name, field="scale_dtype")


def _check_input(x: torch.Tensor, *, name: str) -> None:
    if not x.is_floating_point():
        raise ConfigError(f"only floating-point tensors are quantized, not {x.dtype}", tensor=name, field="dtype")


def _check_float32_range(x: torch.Tensor, *, name: str) -> None:
    """float64 weights beyond float32's range are refused by name: quantization runs in float32, where they
    would become inf and be reported as "NaN or Inf" (the casts to float16/bfloat16 saturate them instead)."""
    if x.dtype == torch.float64 and x.numel():
        big = float(x.abs().nan_to_num(nan=0.0).max())
        if big > torch.finfo(torch.float32).max:
            raise ConfigError(f"values up to {big:.3g} are beyond float32's range, in which quantization runs",
                              tensor=name, field="dtype")


def _nearest_from_float64(x: torch.Tensor, target: torch.dtype) -> torch.Tensor:
    """``x`` (float64, in ``target``'s finite range) rounded to the nearest float16/bfloat16, ties to even.
    torch converts through float32, which rounds twice: 1 + 2⁻¹¹ + 2⁻⁴⁰ became 1.0 in float16, not the
    nearer 1 + 2⁻¹⁰. That conversion is at most one ulp off, so the nearer of it and its neighbour on
    ``x``'s side (compared in float64, where both are exact) is the correctly rounded value."""
    y = x.to(target)
    y64 = y.double()
    toward = torch.where(x > y64, torch.inf, -torch.inf).to(target)
    other = torch.nextafter(y, toward)
    d_y, d_other = (x - y64).abs(), (x - other.double()).abs()
    even = (other.view(torch.int16) & 1) == 0
    return torch.where((d_other < d_y) | ((d_other == d_y) & even & (x != y64)), other, y)


def _cast(x: torch.Tensor, scheme: Scheme, *, name: str) -> QuantizedTensor:
    target = FLOAT_TORCH_DTYPES[scheme.dtype]
    finfo = torch.finfo(target)
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise NonFiniteError("NaN or Inf in the weights", tensor=name)
    if x.dtype == target:
        codes = x.clone()
    elif x.dtype == torch.float64:
        codes = _nearest_from_float64(x.clamp(finfo.min, finfo.max), target)
    elif x.dtype == torch.float32:
        codes = x.clamp(finfo.min, finfo.max).to(target)
    else:  # clamped in float32, where the bounds are exact: float16 cannot hold bfloat16's (it overflowed),
        codes = x.float().clamp_(finfo.min, finfo.max).to(target)  # bfloat16 rounds float16's 65504 to 65536
    return QuantizedTensor(codes=codes, scale=None, zero_point=None, shape=tuple(x.shape), dtype=scheme.dtype,
                           orig_dtype=x.dtype, granularity=scheme.granularity, axis=scheme.axis,
                           group_size=scheme.group_size, symmetric=True, method=scheme.method,
                           observer=scheme.observer)


def quantize(x: torch.Tensor, scheme: Scheme, *, name: str = "tensor",
             observer_range: Range | None = None) -> QuantizedTensor:
    """Quantize ``x`` by ``scheme``; codes keep ``x``'s shape, scale/zero point the CONTRACT §5 shapes.

    ``observer_range=(lo, hi)``, one value per block (any shape of that size), skips observing.
    Raises ConfigError (naming ``name`` and the field) when the scheme cannot apply, NonFiniteError
    for NaN/Inf weights.
    """
    _check_input(x, name=name)
    info = dtype_info(scheme.dtype)
    if info.kind == "float":
        return _cast(x, scheme, name=name)
    _check_float32_range(x, name=name)
    gran = granularity_of(scheme)
    axis = check_applicable(tuple(x.shape), gran, name=name)
    blocks, sshape = block_view(x, gran, name=name)
    codes_dtype = compiled.FP8_TORCH_DTYPES[scheme.dtype] if info.kind == "fp8" else code_dtype(scheme.dtype)
    done: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
    top_scale = None
    small = observer_range is None and scheme.observer == "minmax" and info.kind in ("int", "nf4")
    if kernels.KERNELS.wants(blocks, small=small):
        out = _quantize_compiled(blocks, scheme, info, codes_dtype, observer_range, name=name)
        if out is not None:
            done, top_scale = out[:3], out[3]
    if done is None:
        enc = _Encoder(info, blocks, codes_dtype)
        fused = (observer_range is None and scheme.observer == "minmax" and blocks.shape[0] > 1
                 and blocks.shape[1] <= _chunk_elements(blocks.device))
        if fused:
            done = _quantize_fused_minmax(enc, scheme, name=name)
        else:
            done = _quantize_two_pass(enc, scheme, observer_range, name=name)
    codes, scale, zp = done
    _check_scales_fit(blocks, scale, scheme, name=name, top_scale=top_scale)
    return QuantizedTensor(
        codes=unblock(codes, tuple(x.shape), gran), scale=scale.reshape(sshape),
        zero_point=None if zp is None else zp.reshape(sshape), shape=tuple(x.shape), dtype=scheme.dtype,
        orig_dtype=x.dtype, granularity=scheme.granularity, axis=axis, group_size=scheme.group_size,
        symmetric=zp is None, method=scheme.method, observer=scheme.observer)


def _dequantize_compiled(blocks: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                         info: DTypeInfo) -> torch.Tensor | None:
    """The float32 blocks of ``dequantize`` through one fused kernel; None: run eager."""
    if info.kind == "nf4":
        return compiled.decode_nf4(blocks, scale)
    # (c − 0) · s is c · s exactly: symmetric codes take the same kernel with a zero column.
    zp = torch.zeros_like(scale) if zero_point is None else zero_point.reshape(-1, 1).float()
    return compiled.decode(blocks, scale, zp)


def dequantize(qt: QuantizedTensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x̂`` in ``dtype``, on the device of ``qt.codes``: computed in float32 (what the SDK's NumPy
    dequantizer computes), or in float64 when ``dtype`` is float64, where it is exact (a code, or a
    float32 nf4 level, times a float32 scale needs at most 48 bits): the statistics' ``x̂``."""
    info = dtype_info(qt.dtype)
    if info.kind == "float":
        return qt.codes.to(dtype)
    if qt.scale is None:
        raise ConfigError(f"{qt.dtype} codes need a scale", field="scale")
    if qt.g_idx is not None or qt.channel_scale is not None:
        return _dequantize_columns(qt, dtype)
    gran = granularity_of(qt)
    blocks, _ = block_view(qt.codes, gran, name="codes")
    work = torch.float64 if dtype == torch.float64 else torch.float32
    scale = qt.scale.reshape(-1, 1).to(work)
    if work == torch.float32 and kernels.KERNELS.wants(blocks):
        values = _dequantize_compiled(blocks, scale, qt.zero_point, info)
        if values is not None:
            return unblock(values, qt.shape, gran).to(dtype)
    if info.kind == "nf4":
        cb = NF4_CODEBOOK_F32.to(device=qt.codes.device, dtype=work)
        values = cb[blocks.long()] * scale
    else:  # one new tensor, then in place: the same arithmetic, a third of the allocations and first touches
        values = blocks.to(work, copy=True)
        if qt.zero_point is not None:
            values.sub_(qt.zero_point.reshape(-1, 1).to(work))
        values.mul_(scale)
    return unblock(values, qt.shape, gran).to(dtype)


def _dequantize_columns(qt: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    """``x̂`` of a ``[rows, cols]`` weight (axis 0) whose column ``j`` takes the scale and zero point of group
    ``g_idx[j]`` (else ``j // group_size``) and is divided by ``channel_scale[j]`` (CONTRACT §10)."""
    if qt.scale is None:
        raise ConfigError(f"{qt.dtype} codes need a scale", field="scale")
    work = torch.float64 if dtype == torch.float64 else torch.float32
    rows = qt.shape[0]
    values = qt.codes.reshape(rows, -1).to(work)
    cols = values.shape[1]
    scale = qt.scale.reshape(rows, -1).to(work)
    if qt.g_idx is not None:
        idx = qt.g_idx.to(device=values.device, dtype=torch.long)
    else:
        idx = torch.arange(cols, device=values.device) // (cols // scale.shape[1])
    if qt.zero_point is not None:
        values = values - qt.zero_point.reshape(rows, -1).to(work)[:, idx]
    values = values * scale[:, idx]
    if qt.channel_scale is not None:
        values = values / qt.channel_scale.to(work)
    return values.reshape(qt.shape).to(dtype)


def fake_quantize(x: torch.Tensor, scheme: Scheme, *, name: str = "tensor") -> torch.Tensor:
    """``dequantize(quantize(x))`` in ``x``'s dtype."""
    return dequantize(quantize(x, scheme, name=name), dtype=x.dtype)
