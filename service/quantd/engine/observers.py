"""Range observers: the ``(lo, hi)`` a block of weights or activations is quantized to.

``observe_range(blocks, scheme)`` works on the block view ``[B, K]`` (one range per block row) and is
vectorised over blocks; ``quantize`` calls it for the range. The searches (``mse``, ``entropy``) are
vectorised over their candidates too and chunked so their extra memory stays bounded
(``CHUNK_ELEMENTS`` float32 elements per temporary, a few temporaries alive at once: ≤ ~64 MB).

Observers (``scheme.observer``, arguments in ``scheme.observer_args``):

- ``minmax``: ``lo = min(x)``, ``hi = max(x)`` per block (one ``aminmax`` pass).
- ``percentile`` (``percentile`` = p, default 99.99): symmetric → ``hi = Q_p(|x|)``, ``lo = −hi``;
  affine → ``lo = Q_{100−p}(x)``, ``hi = Q_p(x)``. ``Q`` is ``torch.quantile``'s linear interpolation,
  computed exactly from the needed tail only (``topk``/``kthvalue``), without its 16M-element limit.
- ``meanstd`` (``k``, default 3): ``mean ± k·std`` (population std), clipped to ``[min, max]``.
- ``ema``: on one weight tensor there is nothing to average over, so it equals ``minmax``; its use is
  streaming activations (:class:`quantd.engine.calibration` / ``ActivationObserver``).
- ``mse`` (``grid`` = G, default 100; ``min_ratio``, default 0.2; ``norm`` = n, default 2): clip ratios
  ``r ∈ linspace(min_ratio, 1, G)``; candidate range ``(r·lo, r·hi)`` (affine) or ``±r·absmax``
  (symmetric, nf4, fp8); pick per block the ``r`` minimising ``Σ|x − x̂_r|ⁿ`` where ``x̂_r`` is the
  fake quantization with that range (``choose_qparams``' rules, computed in float32 while searching: see
  :func:`_search_qparams`). ``r = 1`` (min-max) is always a candidate, so the result is never worse than
  min-max. Large grids are searched coarse to fine
  (see :func:`mse_search_indices`).
- ``entropy`` (``bins``, default 2048; ``quant_bins``): the KL-divergence calibration of TensorRT /
  ONNX Runtime, see :func:`entropy_range`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from quantd.engine import kernels
from quantd.engine.qparams import choose_qparams
from quantd.errors import ConfigError, MalformedInputError, NonFiniteError
from quantd_client import Scheme
from quantd_client._dtypes import NF4_CODEBOOK, DTypeInfo, dtype_info

__all__ = [
    "CHUNK_ELEMENTS",
    "MSE_CHUNK_ELEMENTS",
    "ActivationObserver",
    "mse_chunk_plan",
    "mse_search_indices",
    "observe_range",
    "percentile_range",
]

# Float32 elements per temporary in the chunked searches (16 MB); a few temporaries live at once.
CHUNK_ELEMENTS = 1 << 22
# Elements of each of the two [candidates, rows, cols] temporaries of one eager mse chunk (1 MB: they stay in L2).
MSE_CHUNK_ELEMENTS = 1 << 18
# Blocks of at least 2·MSE_SAMPLE values are searched first on a strided sample: every
# min(MSE_SAMPLE_STRIDE, K // MSE_SAMPLE)-th value (≥ MSE_SAMPLE values; sparser samples missed the best clip of heavy tails).
MSE_SAMPLE = 256
MSE_SAMPLE_STRIDE = 4
# Entries of the [candidates, rows] arrays of one mse search step (qparams and errors float32, 4 MiB each; indices 8 MiB).
# Fewer, larger steps: each costs a fixed ~0.4 ms per compiled call.
MSE_QPARAM_ENTRIES = 1 << 20


def observe_range(blocks: torch.Tensor, scheme: Scheme, *, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo[B], hi[B])`` float32 on ``blocks.device`` for the block view ``blocks[B, K]``."""
    if blocks.dim() != 2 or blocks.shape[0] == 0 or blocks.shape[1] == 0:
        raise MalformedInputError(f"observer needs a non-empty 2-D block view [B, K], got shape "
                                  f"{tuple(blocks.shape)}", tensor=name)
    x = blocks.float()
    # amin and amax separately: torch.aminmax over a dim is several times slower on CPU; one fused pass
    # when the compiled kernels run.
    fused = kernels.row_range(x) if kernels.KERNELS.wants(x) else None
    lo, hi = fused if fused is not None else (x.amin(dim=1), x.amax(dim=1))
    if not bool(torch.isfinite(lo).all() & torch.isfinite(hi).all()):
        raise NonFiniteError(f"tensor {name!r} has NaN or Inf values; cannot observe a range", tensor=name)
    info = dtype_info(scheme.dtype)
    obs = scheme.observer
    args = scheme.observer_args
    if obs in ("minmax", "ema") or info.kind == "float":
        return lo, hi
    if obs == "percentile":
        return percentile_range(x, float(args.get("percentile", 99.99)), symmetric=scheme.symmetric)
    if obs == "meanstd":  # in float64: float32 squares of weights near 1e20 overflow (and k·inf or k·0 misled)
        var, mean = torch.var_mean(x.double(), dim=1, correction=0)
        spread = float(args.get("k", 3.0)) * var.sqrt()
        return (torch.maximum(mean - spread, lo.double()).float(), torch.minimum(mean + spread, hi.double()).float())
    if obs == "mse":
        return _mse_range(x, lo, hi, scheme, info)
    if obs == "entropy":
        return entropy_range(x, lo, hi, scheme, info)
    raise MalformedInputError(f"unknown observer {obs!r}", tensor=name, field="observer")


# --------------------------------------------------------------------------------------------- percentile


def _upper_quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.quantile(x, q, dim=1)`` (linear interpolation), from the top ``K − ⌊q(K−1)⌋`` values only."""
    rows, k = x.shape
    pos = q * (k - 1)
    i0 = min(math.floor(pos), k - 1)
    i1 = min(i0 + 1, k - 1)
    frac = pos - i0
    out = torch.empty(rows, dtype=x.dtype, device=x.device)
    tail = k - i0  # values at ascending indices i0 and i1 are the tail-th and (tail−1)-th largest
    step = max(1, CHUNK_ELEMENTS // max(k, 1))
    for r in range(0, rows, step):
        xc = x[r:r + step]
        if tail <= k // 2 + 1:
            top = torch.topk(xc, tail, dim=1, largest=True, sorted=True).values
            v0, v1 = top[:, tail - 1], top[:, max(tail - 2, 0)]
        else:
            v0 = torch.kthvalue(xc, i0 + 1, dim=1).values
            v1 = torch.kthvalue(xc, i1 + 1, dim=1).values if i1 != i0 else v0
        out[r:r + step] = v0 + (v1 - v0) * frac
    return out


def percentile_range(x: torch.Tensor, p: float, *, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Range from the ``p``-th percentile per row of ``x[B, K]`` (exact, any size)."""
    q = p / 100.0
    if symmetric:
        hi = _upper_quantile(x.abs(), q)
        return -hi, hi
    # Q_{1−q}(x) = −Q_q(−x): the lower tail is the upper tail of −x.
    return -_upper_quantile(-x, q), _upper_quantile(x, q)


# -------------------------------------------------------------------------------------------------- mse


def mse_chunk_plan(rows: int, candidates: int, cols: int, budget: int | None = None) -> tuple[int, int, int]:
    """``(rows, candidates, cols)`` per chunk of the ``[rows, candidates, cols]`` error tensor, so that
    one chunk holds at most ``budget`` (default ``MSE_CHUNK_ELEMENTS``) elements (columns are split only
    when one row alone is larger)."""
    budget = MSE_CHUNK_ELEMENTS if budget is None else budget
    cols_c = min(cols, budget)
    cand_c = max(1, min(candidates, budget // cols_c))
    rows_c = max(1, min(rows, budget // (cand_c * cols_c)))
    return rows_c, cand_c, cols_c


def coarse_grid(grid: int, points: int) -> tuple[list[int], int]:
    """``points`` indices of ``range(grid)`` spaced ``⌈(grid − 1) / points⌉`` apart, ending at the last,
    and that spacing; grids up to 16: all indices, spacing 0."""
    if grid <= 16:
        return list(range(grid)), 0
    spacing = math.ceil((grid - 1) / max(points, 1))
    return list(range(grid - 1, -1, -spacing))[::-1], spacing


def mse_search_indices(grid: int, points: int = 4) -> tuple[list[int], list[list[int]]]:
    """The mse search plan: grid indices evaluated first, then per refinement stage the offsets tried
    around each row's best index so far.

    Grids up to 16 are searched exhaustively (no stages). Larger grids evaluate ``points`` ratios
    spaced ``S = ⌈(G − 1) / points⌉`` apart, ending at ``r = 1``; each stage then divides the spacing by
    about 3 and tries ``±`` the new spacing around the best point, and the first stage twice that too
    (25 → 8 → 3 → 1 for G = 100: ±8, ±16; ±3; ±1): 12 evaluations in 4 batched calls instead of G, for
    every dtype. Simulated on exhaustive 100-ratio error tables of g64 blocks (Gaussian, Student-t(3),
    all-MiniLM-L6-v2), this plan's total MSE is 0.03–0.10 % (nf4) and 0.02–0.08 % (int4) above the
    exhaustive optimum; the 16-evaluation plan that tried every multiple of the new spacing within the
    old one (±9, ±18; ±3, ±6; ±1, ±2) was 0.02–0.06 % and 0.01–0.04 % above it, in a third more time.
    nf4 and fp8 errors are more jagged in ``r`` (non-uniform levels), but 8 coarse points found no better
    ranges for them: over 14 weights their MSE came out 0.02–0.14 % higher than with 4, in 6–22 % more
    time. The best ratio evaluated anywhere wins, so the result is never worse than min-max.
    """
    coarse, spacing = coarse_grid(grid, points)
    stages: list[list[int]] = []
    reach = 2
    while spacing > 1:
        finer = max(1, round(spacing / 3))
        stages.append([k * finer for k in range(-reach, reach + 1) if k])
        reach, spacing = 1, finer
    return coarse, stages


def _fake_quant_error(x: torch.Tensor, scale: torch.Tensor, inv: torch.Tensor, zp: torch.Tensor, info: DTypeInfo,
                      dtype: str, norm: float, buf: torch.Tensor, buf2: torch.Tensor) -> torch.Tensor:
    """``Σ_k |x − x̂|ⁿ`` → ``[C, R]`` for ``x[R, K]`` and float32 candidate qparams ``[C, R]`` (scale, its
    reciprocal, zero point: zeros when symmetric).

    ``buf``, ``buf2`` (≥ C·R·K float32 elements each) hold the ``[C, R, K]`` temporaries; ops run in place.
    Integer dtypes work in the code domain: ``x − x̂ = s·(x/s + zp − clamp(round(x/s + zp)))``, so the
    error is ``sⁿ·Σ|t − q|ⁿ`` with ``t = x·(1/s) + zp`` and no per-candidate clamp bounds (five passes).
    """
    shape = (*scale.shape, x.shape[1])
    n = scale.numel() * x.shape[1]
    s = scale.unsqueeze(-1)
    xe = x.unsqueeze(0)
    t = buf[:n].view(shape)
    if info.kind == "int":  # x · (1/s), not x / s: an estimate of the error, not the codes (see kernels)
        torch.addcmul(zp.unsqueeze(-1), xe, inv.unsqueeze(-1), out=t)
        q = torch.round(t, out=buf2[:n].view(shape)).clamp_(info.qmin, info.qmax)
        d = t.sub_(q)
        if norm == 2.0:
            e2: torch.Tensor = torch.linalg.vecdot(d, d)
            return e2.mul_(scale.square())
        en: torch.Tensor = torch.linalg.vector_norm(d, ord=norm, dim=-1)
        return en.pow_(norm).mul_(scale.pow(norm))
    torch.div(xe, s, out=t)
    if info.kind == "nf4":
        cb = torch.tensor(NF4_CODEBOOK, dtype=x.dtype, device=x.device)
        idx = torch.bucketize(t, (cb[1:] + cb[:-1]) / 2)
        t = cb[idx].mul_(s)
    else:  # fp8: saturate, then cast (the float8 cast of an out-of-range value is NaN)
        t = t.clamp_(-info.max_finite, info.max_finite).to(kernels.FP8_TORCH_DTYPES[dtype]).to(x.dtype).mul_(s)
    err: torch.Tensor = torch.linalg.vector_norm(t.sub_(xe), ord=norm, dim=-1)
    return err.square_() if norm == 2.0 else err.pow_(norm)


def _reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale``, finite: float32 and bfloat16 scales go down to 2⁻¹⁴⁹, whose reciprocal is inf (and
    0 · inf a NaN error for an all-zero block); the largest float32 instead gives ``x · (1/s)`` of 0."""
    return scale.reciprocal().clamp_(max=torch.finfo(torch.float32).max)


def _search_qparams(lo_r: torch.Tensor, hi_r: torch.Tensor, dtype: str, symmetric: bool,
                    scale_dtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scale, its reciprocal and zero point (zeros when symmetric or not an integer dtype) of the
    candidate ranges ``(lo_r, hi_r)``, all float32: ``choose_qparams`` working in float32, whose scales
    may be an ulp of ``scale_dtype`` away from float64's (about 1 in 10⁴ candidates for float16/bfloat16
    scales). The search ranks its candidates on these, and the range it picks gets ``choose_qparams``'
    own qparams. Float32 is what keeps a search step's qparams cheap: the float64 steps were 3x slower,
    on every candidate of every block."""
    scale, zp = choose_qparams(lo_r, hi_r, dtype=dtype, symmetric=symmetric, scale_dtype=scale_dtype,
                               work_dtype=torch.float32)
    s = scale.float()
    return s, _reciprocal(s), (torch.zeros_like(s) if zp is None else zp.float())


class _Grid:
    """The mse search's ratios ``linspace(min_ratio, 1, G)`` as the search's kernels compute them:
    ``start + i·step`` and exactly 1 at ``i = G − 1`` (within an ulp of the linspace values, which the
    picked range uses), with the three numbers as 0-d tensors so that one compiled kernel serves every grid."""

    def __init__(self, min_ratio: float, grid: int, device: torch.device) -> None:
        self.size = grid
        self.ratios = (torch.linspace(min_ratio, 1.0, grid, device=device) if grid > 1
                       else torch.ones(1, device=device))
        self.start = torch.tensor(min_ratio, dtype=torch.float32, device=device)
        self.step = torch.tensor((1.0 - min_ratio) / max(grid - 1, 1), dtype=torch.float32, device=device)
        self.last = torch.tensor(grid - 1, dtype=torch.long, device=device)


def _stage_candidates(lo: torch.Tensor, hi: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                      start: torch.Tensor, step: torch.Tensor, last: torch.Tensor, dtype: str, symmetric: bool,
                      scale_dtype: str) -> tuple[torch.Tensor, ...]:
    cols = []
    for c in range(offsets.shape[0]):  # C is static: compiled, one vectorised loop over the blocks per candidate
        idx = (b + offsets[c]).clamp(min=0).clamp(max=last)
        r = torch.where(idx == last, 1.0, start + idx.float() * step)
        cols.append((idx, *_search_qparams(lo * r, hi * r, dtype, symmetric, scale_dtype)))
    return tuple(torch.stack(col) for col in zip(*cols, strict=True))


def stage_candidates(lo: torch.Tensor, hi: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, grid: _Grid,
                     scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One search step's candidates, ``[C, B]`` each: the grid indices ``clamp(b + offsets, 0, G − 1)``
    around each block's best ``b[B]`` (``b = 0`` with the coarse indices as offsets for the first step),
    and the float32 scale, reciprocal and zero point of their ranges ``(r·lo, r·hi)``
    (:func:`_search_qparams`). Candidate-major: each candidate's values are one contiguous row, which
    the compiled step (:func:`search_step`) reads and writes as whole vectors (a ``[B, C]`` layout with
    C = 4 made its candidate and pick loops scalar code, 3.6x slower at B = 262 144); gathering ``r``
    from a table of ratios was slower than computing it."""
    idx, scale, inv, zp = _stage_candidates(lo, hi, b, offsets, grid.start, grid.step, grid.last, scheme.dtype,
                                            scheme.symmetric, scheme.scale_dtype)
    return idx, scale, inv, zp


def _candidate_errors(x: torch.Tensor, scale: torch.Tensor, inv: torch.Tensor, zp: torch.Tensor, scheme: Scheme,
                      info: DTypeInfo, norm: float) -> torch.Tensor:
    """Errors ``[C, B]`` of the blocks ``x[B, K]`` under the candidate qparams ``[C, B]``, eager: in
    chunks of ``[C, B, K]`` temporaries bounded by :func:`mse_chunk_plan`."""
    rows, k = x.shape
    cands = scale.shape[0]
    rows_c, cand_c, cols_c = mse_chunk_plan(rows, cands, k)
    buf = torch.empty(rows_c * cand_c * cols_c, dtype=torch.float32, device=x.device)
    buf2 = torch.empty_like(buf)
    err = torch.zeros(cands, rows, dtype=torch.float32, device=x.device)
    for r in range(0, rows, rows_c):
        rs = slice(r, r + rows_c)
        for c in range(0, cands, cand_c):
            cs = slice(c, c + cand_c)
            for j in range(0, k, cols_c):
                err[cs, rs] += _fake_quant_error(x[rs, j:j + cols_c], scale[cs, rs], inv[cs, rs], zp[cs, rs], info,
                                                 scheme.dtype, norm, buf, buf2)
    return err


def pick_best(err: torch.Tensor, idx: torch.Tensor, b: torch.Tensor,
              e_best: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the mse search: per block, the first candidate of least error in ``err[C, B]`` (grid
    indices ``idx[C, B]``) replaces the best so far ``b``/``e_best`` ``[B]`` where it is strictly better;
    returns the new ``(b, e_best)``. A scan over the C candidate rows."""
    best, pos = err[0], idx[0]
    for c in range(1, err.shape[0]):
        col = err[c]
        pos = torch.where(col < best, idx[c], pos)  # strictly: a tie keeps the first candidate
        best = torch.minimum(best, col)
    better = best < e_best  # strictly: an equal error keeps the point found first
    return torch.where(better, pos, b), torch.minimum(best, e_best)


def _step(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
          e_best: torch.Tensor, start: torch.Tensor, step: torch.Tensor, last: torch.Tensor, dtype: str,
          symmetric: bool, scale_dtype: str, qmin: torch.Tensor, qmax: torch.Tensor, kind: str,
          fp8: tuple[float, int, int], norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    idx, scale, inv, zp = _stage_candidates(lo, hi, b, offsets, start, step, last, dtype, symmetric, scale_dtype)
    err = kernels.candidate_error(x, scale, inv, zp, qmin, qmax, kind, fp8, norm)
    return pick_best(err, idx, b, e_best)


def _step_nf4(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return _step(*args)


def search_step(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                e_best: torch.Tensor, grid: _Grid, scheme: Scheme, info: DTypeInfo, norm: float, *,
                compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the mse search: the candidates around ``b`` (:func:`stage_candidates`), their errors
    and the new best (:func:`pick_best`). ``compiled``: one compiled graph, whose error loop is
    :func:`kernels.candidate_error` with no ``[C, B, K]`` temporary (5 % faster for nf4 at g64 than
    three kernels called in turn); otherwise, or when compiling is off, eager, with the chunked
    :func:`_candidate_errors`."""
    if compiled:
        # nf4: its own compiled function (and Dynamo's budget of variants), one variant per fixed block length
        name, fn, fixed = ("mse_step_nf4", _step_nf4, kernels.fix_block_length(x)) if info.kind == "nf4" else (
            "mse_step", _step, None)
        out = kernels.KERNELS.call(
            name, fn, (x.dtype, scheme.dtype, scheme.symmetric, scheme.scale_dtype, float(norm), fixed),
            x, lo, hi, b, offsets, e_best, grid.start, grid.step, grid.last, scheme.dtype, scheme.symmetric,
            scheme.scale_dtype, *kernels.error_args(info, scheme.dtype), float(norm), options=kernels.NO_REALIZE)
        if out is not None:
            return out
    idx, scale, inv, zp = stage_candidates(lo, hi, b, offsets, grid, scheme)
    err = _candidate_errors(x, scale, inv, zp, scheme, info, norm)
    return pick_best(err, idx, b, e_best)  # the first of equal errors wins, as does the point found first


def _search(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, steps: list[tuple[torch.Tensor | None, torch.Tensor]],
            grid: _Grid, scheme: Scheme, info: DTypeInfo, norm: float) -> torch.Tensor:
    """Grid index ``[B]`` of the least error found for each block of ``x`` over the search ``steps``:
    each step a base index (``[B]``, 0-d for all blocks, or None for each block's best so far) and the
    offsets tried around it. The start is ratio 1 (min-max) with an infinite error, so the first step's
    candidates replace it."""
    compiled = kernels.KERNELS.wants(x, small=True)
    b = torch.full((x.shape[0],), grid.size - 1, dtype=torch.long, device=x.device)
    e_best = torch.full((x.shape[0],), float("inf"), device=x.device)
    for base, offsets in steps:
        b, e_best = search_step(x, lo, hi, b if base is None else base.expand_as(b), offsets, e_best, grid, scheme,
                                info, norm, compiled=compiled)
    return b


def _mse_search(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, grid: _Grid, scheme: Scheme,
                info: DTypeInfo, norm: float) -> torch.Tensor:
    """Grid index ``[B]`` of the ratio minimising the error of each row of ``x``: a coarse grid, then
    coarse-to-fine stages around each row's best (:func:`mse_search_indices`), every stage one batched
    evaluation of all rows × its candidates."""
    coarse, stages = mse_search_indices(grid.size)
    zero = torch.zeros((), dtype=torch.long, device=x.device)
    steps: list[tuple[torch.Tensor | None, torch.Tensor]] = [(zero, torch.tensor(coarse, device=x.device))]
    steps += [(None, torch.tensor(o, device=x.device)) for o in stages]  # coarse first, ascending r: ties keep it
    best = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    # Rows per search: bounds the [rows, candidates] qparams/error arrays.
    rows = max(1, MSE_QPARAM_ENTRIES // max([len(coarse), *(len(o) for o in stages)]))  # no stages up to G = 16
    for r in range(0, x.shape[0], rows):
        best[r:r + rows] = _search(x[r:r + rows], lo[r:r + rows], hi[r:r + rows], steps, grid, scheme, info, norm)
    return best


def _mse_range(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scheme: Scheme,
               info: DTypeInfo) -> tuple[torch.Tensor, torch.Tensor]:
    args = scheme.observer_args
    grid = _Grid(float(args.get("min_ratio", 0.2)), int(args.get("grid", 100)), x.device)
    norm = float(args.get("norm", 2.0))
    lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    if scheme.symmetric:
        amax = torch.maximum(-lo, hi)
        lo, hi = -amax, amax
    k = x.shape[1]
    if k < 2 * MSE_SAMPLE:
        best = _mse_search(x, lo, hi, grid, scheme, info, norm)
    else:
        # Large blocks: search on a strided sample (every MSE_SAMPLE_STRIDE-th value, ≥ MSE_SAMPLE; an
        # unbiased estimate of the error, candidates still scaled from the full block's range), then rank
        # the sample's best ratio, its neighbours and r = 1 (the offset G clamps to G − 1) on the full
        # blocks: never worse than min-max.
        sample = x[:, :: min(MSE_SAMPLE_STRIDE, k // MSE_SAMPLE)].contiguous()  # read ~15 times: unit stride pays
        b = _mse_search(sample, lo, hi, grid, scheme, info, norm)
        final = torch.tensor([-1, 0, 1, grid.size], device=x.device)
        best = _search(x, lo, hi, [(b, final)], grid, scheme, info, norm)
    ratio = grid.ratios[best]
    return lo * ratio, hi * ratio


# ---------------------------------------------------------------------------------------------- entropy

# Thresholds tried per block by the entropy observer (evenly spaced window widths, both ends included).
ENTROPY_MAX_CANDIDATES = 128
# Histogram entries (int64) the entropy observer holds at once: blocks are calibrated in chunks of this many
# blocks × bins (32 MiB).
ENTROPY_HIST_ENTRIES = 1 << 22
# Blocks of fewer values keep their min-max range under the entropy observer: a histogram of a handful of
# values has no tail to clip, and its cost (∝ blocks · candidates · bins, at least 2·quant_bins bins) per
# value would be hundreds of times min-max's (62 s for a 256×256 weight at group_size 1).
ENTROPY_MIN_VALUES = 16


def batched_histogram(v: torch.Tensor, a: torch.Tensor, width: torch.Tensor, nbins: int) -> torch.Tensor:
    """Per-row histograms ``[B, nbins]`` (int64) of ``v[B, K]`` over ``[a, a + nbins·width]``.

    Values outside fall into the first/last bin. One ``bincount`` on row-offset bin indices per chunk.
    """
    rows, k = v.shape
    hist = torch.zeros(rows, nbins, dtype=torch.int64, device=v.device)
    cols_c = min(k, CHUNK_ELEMENTS)
    rows_c = max(1, CHUNK_ELEMENTS // cols_c)
    for r in range(0, rows, rows_c):
        n = min(rows_c, rows - r)
        offs = torch.arange(n, device=v.device).unsqueeze(1) * nbins
        for j in range(0, k, cols_c):
            t = (v[r:r + n, j:j + cols_c] - a[r:r + n, None]) / width[r:r + n, None]
            idx = t.floor_().clamp_(0, nbins - 1).long() + offs
            hist[r:r + n] += torch.bincount(idx.flatten(), minlength=n * nbins).view(n, nbins)
    return hist


def _smooth(d: torch.Tensor, inwin: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """ONNX Runtime's ``smooth_distribution``: move ``eps`` mass onto the empty bins of the window."""
    zeros = (d == 0) & inwin
    nonzeros = (d != 0) & inwin
    n_zeros = zeros.sum(-1, keepdim=True)
    n_nonzeros = nonzeros.sum(-1, keepdim=True).clamp(min=1)
    return d + eps * zeros - (eps * n_zeros / n_nonzeros) * nonzeros


def kl_divergences(hist: torch.Tensor, start: torch.Tensor, width: torch.Tensor, levels: int) -> torch.Tensor:
    """``KL(P‖Q)`` ``[B, C]`` of each candidate window ``[start, start + width)`` (in bins) of ``hist[B, n]``.

    As TensorRT / ONNX Runtime: P = the window's bins with the mass outside added to its two edge bins;
    Q = the window (without that mass) merged into ``levels`` runs of ``width // levels`` bins (the rest
    to the last), each run's mass spread evenly over its bins that are non-empty in P; both smoothed
    (ONNX ``smooth_distribution``); KL of the normalised distributions; ``inf`` when Q is empty.
    ``start[B, C]``, ``width[C]`` or ``[B, C]`` (≥ ``levels``). Computed in window coordinates
    ``j = 0 … max(width)−1`` with run sums from prefix sums, so only gathers (no scatters) touch the
    ``[B, C, n]`` temporaries.
    """
    rows, n = hist.shape
    dev = hist.device
    w = width if width.dim() == 2 else width.unsqueeze(0)  # [B | 1, C]
    cands = w.shape[1]
    h = hist.float()
    zero = torch.zeros(rows, 1, device=dev)
    prefix = torch.cat([zero, h.cumsum(1)], 1)  # [B, n + 1]
    nz_prefix = torch.cat([zero, (h > 0).float().cumsum(1)], 1)
    # Window coordinates up to the widest candidate only: the bins beyond are masked out anyway.
    j = torch.arange(min(n, int(w.max())), device=dev)
    inwin = j < w.unsqueeze(-1)  # [B | 1, C, n']
    merged = torch.div(w, levels, rounding_mode="floor").unsqueeze(-1)  # [B | 1, C, 1]
    run = torch.minimum(torch.div(j, merged, rounding_mode="floor"), torch.tensor(levels - 1, device=dev))
    l_idx = torch.arange(levels, device=dev)
    r_lo = l_idx * merged  # [B | 1, C, L] run bounds, window coordinates
    r_hi = torch.where(l_idx == levels - 1, w.unsqueeze(-1), r_lo + merged)
    end = start + w  # [B, C]
    absolute = (start.unsqueeze(-1) + j).clamp_(max=n - 1)  # [B, C, n']
    sliced = torch.where(inwin, h.gather(1, absolute.view(rows, -1)).view(absolute.shape), 0.0)
    left = prefix.gather(1, start)
    right = prefix[:, -1:] - prefix.gather(1, end)
    last = (w - 1).unsqueeze(-1).expand(rows, cands, 1)
    p = sliced.clone()
    p[:, :, 0] += left
    p.scatter_add_(2, last, right.unsqueeze(-1))

    def run_gather(pre: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:  # pre[B, n+1] at start + bounds
        idx = (start.unsqueeze(-1) + bounds).reshape(rows, -1)
        return pre.gather(1, idx).view(rows, cands, levels)

    qsum = run_gather(prefix, r_hi) - run_gather(prefix, r_lo)  # [B, C, L]
    qcnt = run_gather(nz_prefix, r_hi) - run_gather(nz_prefix, r_lo)
    # P's edge bins may be non-empty only thanks to the outside mass: count them as non-empty too.
    qcnt[:, :, 0] += ((left > 0) & (sliced[:, :, 0] == 0)).float()
    last_bin = sliced.gather(2, last).squeeze(-1)
    last_run = run.expand(rows, -1, -1).gather(2, last)  # [B, C, 1]
    extra = ((right > 0) & (last_bin == 0) & ((w > 1) | (left == 0))).float()
    qcnt.scatter_add_(2, last_run, extra.unsqueeze(-1))
    avg = qsum / qcnt.clamp(min=1.0)
    nz = (p > 0) & inwin
    q = torch.where(nz, avg.gather(2, run.expand(rows, -1, -1)), 0.0)
    empty_q = q.sum(-1) <= 0
    p, q = _smooth(p, inwin), _smooth(q, inwin)
    p = p / p.sum(-1, keepdim=True)
    q = q / q.sum(-1, keepdim=True)
    terms = torch.where(inwin & (p > 0), p * (p / q.clamp(min=1e-30)).log(), 0.0)
    return torch.where(empty_q, torch.inf, terms.sum(-1))


def _entropy_kl(hist: torch.Tensor, zero_pos: torch.Tensor, widths: torch.Tensor, levels: int,
                nbins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KL ``[B, C]`` and window starts ``[B, C]`` of the windows ``widths[B, C]`` placed around each
    block's zero bin (shrinking both ends in proportion), in chunks of ~``CHUNK_ELEMENTS // 4``
    ``[rows, candidates, bins]`` elements (about ten such temporaries live at once)."""
    rows, cands = widths.shape
    start = (zero_pos * (1.0 - widths.float() / nbins)).round().long()
    start = torch.minimum(start.clamp(min=0), nbins - widths)
    kl = torch.empty(rows, cands, dtype=torch.float32, device=hist.device)
    budget = CHUNK_ELEMENTS // 4
    cand_c = max(1, min(cands, budget // nbins))
    rows_c = max(1, budget // (cand_c * nbins))
    for r in range(0, rows, rows_c):
        for c in range(0, cands, cand_c):
            kl[r:r + rows_c, c:c + cand_c] = kl_divergences(hist[r:r + rows_c], start[r:r + rows_c, c:c + cand_c],
                                                           widths[r:r + rows_c, c:c + cand_c], levels)
    return kl, start


def entropy_range(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scheme: Scheme,
                  info: DTypeInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """KL-divergence calibration per block row of ``x[B, K]`` (``lo``/``hi``: its min/max).

    Symmetric: histogram of ``|x|`` over ``[0, absmax]``, windows ``[0, t)``, ``quant_bins`` defaults to
    half the levels (128 for int8, as TensorRT). Affine: histogram of ``x`` over ``[min(lo,0), max(hi,0)]``,
    windows shrinking both ends towards 0 in proportion (the affine clip ``(r·lo, r·hi)``), ``quant_bins``
    defaults to all the levels. The histogram has ``min(bins, max(2·quant_bins, min(K // 4, max(4·quant_bins, K // 8))))``
    bins (4 values a bin at least, 8 beyond 4·quant_bins bins: a block cannot fill 2048 bins, and the
    cost grows with the bins), and at most ``ENTROPY_MAX_CANDIDATES``
    window widths (evenly spaced) are searched per block coarse to fine as in ``mse``
    (:func:`mse_search_indices`: ~31 KL evaluations of 128). Cost ∝ B · candidates · bins.
    nf4 and fp8 are treated as 16 / 256 uniform levels: an approximation of their non-uniform grids.
    Blocks of fewer than ``ENTROPY_MIN_VALUES`` values keep their min-max range.
    """
    args = scheme.observer_args
    total_levels = info.levels if info.kind == "int" else 2 ** info.bits
    levels = int(args.get("quant_bins", total_levels // 2 if scheme.symmetric else total_levels))
    levels = max(levels, 1)
    k = x.shape[1]
    if k < ENTROPY_MIN_VALUES:
        return lo, hi
    nbins = max(levels, min(int(args.get("bins", 2048)), max(2 * levels, min(k // 4, max(4 * levels, k // 8)))))
    # Blocks in chunks: the histograms are [rows, nbins] int64, whatever the number of blocks (one a value
    # at group_size 1).
    rows = max(1, ENTROPY_HIST_ENTRIES // nbins)
    parts = [_entropy_rows(x[r:r + rows], lo[r:r + rows], hi[r:r + rows], scheme.symmetric, levels, nbins)
             for r in range(0, x.shape[0], rows)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _entropy_rows(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, symmetric: bool, levels: int,
                  nbins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`entropy_range` of the blocks ``x[B, K]``, with ``levels`` quantization bins over ``nbins``."""
    lo0, hi0 = lo.clamp(max=0.0), hi.clamp(min=0.0)
    if symmetric:
        v, a, b = x.abs(), torch.zeros_like(lo0), torch.maximum(-lo0, hi0)
    else:
        v, a, b = x, lo0, hi0
    bin_w = (b - a) / nbins
    empty = bin_w <= 0
    bin_w = torch.where(empty, torch.ones_like(bin_w), bin_w)
    hist = batched_histogram(v, a, bin_w, nbins)
    zero_pos = (-a / bin_w).unsqueeze(1)  # the bin position of 0 (0 for symmetric)
    n_cand = min(nbins - levels + 1, ENTROPY_MAX_CANDIDATES)
    step = (nbins - levels) / max(n_cand - 1, 1)
    grid = torch.tensor(sorted({round(levels + i * step) for i in range(n_cand)}), device=x.device)
    coarse, radius = coarse_grid(grid.numel(), 4)
    idx = torch.tensor(coarse, device=x.device).expand(x.shape[0], -1)
    kl, start = _entropy_kl(hist, zero_pos, grid[idx], levels, nbins)
    b = idx.gather(1, kl.argmin(1, keepdim=True))
    if radius:  # the widths around each block's best coarse width
        idx = (b + torch.arange(-radius, radius + 1, device=x.device)).clamp(0, grid.numel() - 1)
        kl, start = _entropy_kl(hist, zero_pos, grid[idx], levels, nbins)
    pick = kl.argmin(1, keepdim=True)
    best = grid[idx.gather(1, pick).squeeze(1)]
    best_start = start.gather(1, pick).squeeze(1)
    t_lo = a + best_start * bin_w
    t_hi = a + (best_start + best) * bin_w
    if symmetric:
        t_lo = -t_hi
    return torch.where(empty, lo0, t_lo), torch.where(empty, hi0, t_hi)


# ----------------------------------------------------------------------------------- streaming activations

# Reservoir bounds: at most RESERVOIR_PER_CHANNEL samples per tensor/channel, RESERVOIR_TOTAL in all
# (but never fewer than RESERVOIR_MIN per channel).
RESERVOIR_PER_CHANNEL = 1 << 20
RESERVOIR_TOTAL = 1 << 22
RESERVOIR_MIN = 4096


class ActivationObserver:
    """Observes a stream of activation batches ``[N, ...]`` and gives their range and qparams.

    Granularity ``tensor`` (one range) or ``channel`` on ``axis`` (default ``scheme.axis``; −1 for the
    features of ``[N, ..., F]``). State is bounded whatever the stream length:

    - ``minmax``: running min/max per tensor/channel.
    - ``ema``: ``r ← (1 − m)·r + m·r_batch`` of the per-batch min and max (momentum ``m``, default
      0.01); the first batch initialises.
    - ``percentile``, ``meanstd``, ``mse``, ``entropy``: a uniform reservoir sample (Vitter's algorithm
      R, vectorised per batch) of at most ``RESERVOIR_PER_CHANNEL`` values per tensor/channel
      (``RESERVOIR_TOTAL`` over all channels); ``range()`` runs :func:`observe_range` on it. Exact
      while the stream fits in the reservoir, a uniform-sample estimate beyond.

    ``num_samples`` counts the rows (the leading dimension ``N``) seen.
    """

    def __init__(self, scheme: Scheme, *, name: str = "activation", axis: int | None = None,
                 reservoir_size: int | None = None, seed: int = 0) -> None:
        if scheme.granularity == "group":
            raise ConfigError("activation observers work per tensor or per channel", tensor=name,
                              field="granularity")
        if dtype_info(scheme.dtype).kind == "float":
            raise ConfigError(f"{scheme.dtype} is a plain cast and has no range to calibrate", tensor=name,
                              field="dtype")
        self.scheme = scheme
        self.name = name
        self.axis = scheme.axis if axis is None else axis
        self.num_samples = 0
        self.momentum = float(scheme.observer_args.get("momentum", 0.01))
        self._reservoir_size = reservoir_size
        self._seed = seed
        self._lo: torch.Tensor | None = None
        self._hi: torch.Tensor | None = None
        self._res: torch.Tensor | None = None
        self._seen = 0  # values per channel offered to the reservoir
        self._gen: torch.Generator | None = None

    @property
    def per_channel(self) -> bool:
        return self.scheme.granularity == "channel"

    def _rows(self, batch: torch.Tensor) -> torch.Tensor:
        """``[C, m]``: one row per tensor (C = 1) or channel."""
        if not self.per_channel:
            return batch.reshape(1, -1)
        if not -batch.dim() <= self.axis < batch.dim():
            raise ConfigError(f"axis {self.axis} is out of range for a batch of shape {tuple(batch.shape)}",
                              tensor=self.name, field="axis")
        axis = self.axis % batch.dim()
        v = batch.movedim(axis, 0).reshape(batch.shape[axis], -1)
        if self._lo is not None and self._lo.shape[0] != v.shape[0]:
            raise MalformedInputError(f"batch has {v.shape[0]} channels on axis {self.axis}, earlier batches "
                                      f"had {self._lo.shape[0]}", tensor=self.name)
        return v

    def update(self, batch: torch.Tensor) -> None:
        """Observe one batch ``[N, ...]`` (N rows)."""
        self._check_batch(batch)
        v = self._rows(batch.detach().float())
        lo, hi = torch.aminmax(v, dim=1)
        self._check_range(lo, hi)
        if self._lo is None or self._hi is None:
            self._lo, self._hi = lo, hi
        elif self.scheme.observer == "ema":
            self._lo = torch.lerp(self._lo, lo, self.momentum)
            self._hi = torch.lerp(self._hi, hi, self.momentum)
        else:
            self._lo, self._hi = torch.minimum(self._lo, lo), torch.maximum(self._hi, hi)
        if self.scheme.observer not in ("minmax", "ema"):
            self._sample(v)
        self.num_samples += int(batch.shape[0])

    def _check_batch(self, batch: torch.Tensor) -> None:
        if batch.dim() == 0 or batch.numel() == 0:
            raise MalformedInputError(f"activation batch must be [N, ...] and non-empty, got shape "
                                      f"{tuple(batch.shape)}", tensor=self.name)

    def _check_range(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        if not bool(torch.isfinite(lo).all() & torch.isfinite(hi).all()):
            raise NonFiniteError(f"activation {self.name!r} has NaN or Inf values", tensor=self.name)

    def update_samples(self, batch: torch.Tensor) -> None:
        """Observe the ``N`` samples of ``batch [N, ...]`` as ``N`` consecutive batches of one: the ``ema``
        average steps once per sample (the closed form of the ``N`` steps, weights in float64, equal to
        :meth:`update` called per sample to float32 rounding). The other observers do not depend on
        how the stream is batched, and see ``batch`` at once. A calibration file holds each layer's samples
        as one tensor: per sample is the only batching it tells."""
        self._check_batch(batch)
        n = batch.shape[0]
        # per channel, a sample's channels must lie on another axis than N's
        per_sample = not self.per_channel or (batch.dim() >= 2 and self.axis % batch.dim() != 0)
        if self.scheme.observer != "ema" or n == 1 or not per_sample:
            self.update(batch)
            return
        v = batch.detach().float()
        if self.per_channel:
            self._rows(batch[:1])  # the axis and channel count checks
            v = v.movedim(self.axis % v.dim(), 1).reshape(n, v.shape[self.axis], -1)
        else:
            v = v.reshape(n, 1, -1)
        lo_s, hi_s = torch.aminmax(v, dim=2)  # [N, C]
        self._check_range(lo_s, hi_s)
        steps = n - 1 if self._lo is None else n  # the first sample of a stream initialises
        keep = 1.0 - self.momentum  # r_k = keep^k·r_0 + Σ_j m·keep^(k−1−j)·x_j
        powers = torch.pow(torch.tensor(keep, dtype=torch.float64, device=v.device),
                           torch.arange(steps, -1, -1, dtype=torch.float64, device=v.device))  # keep^k … keep^0
        weights = (powers[1:] * self.momentum).unsqueeze(1)

        def average(prior: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
            return (powers[0] * prior.double() + (weights * xs.double()).sum(0)).float()

        if self._lo is None or self._hi is None:
            self._lo, self._hi = average(lo_s[0], lo_s[1:]), average(hi_s[0], hi_s[1:])
        else:
            self._lo, self._hi = average(self._lo, lo_s), average(self._hi, hi_s)
        self.num_samples += n

    def _capacity(self, channels: int) -> int:
        if self._reservoir_size is not None:
            return max(1, self._reservoir_size)
        return min(RESERVOIR_PER_CHANNEL, max(RESERVOIR_MIN, RESERVOIR_TOTAL // channels))

    def _sample(self, v: torch.Tensor) -> None:
        """Algorithm R over the columns of ``v[C, m]``: value number t (0-based) replaces slot
        ``j ~ U{0..t}`` when ``j < capacity``; within a batch the last writer of a slot wins."""
        channels, m = v.shape
        if self._res is None:
            self._res = torch.empty(channels, self._capacity(channels), dtype=torch.float32, device=v.device)
            self._gen = torch.Generator(device=v.device).manual_seed(self._seed)
        res = self._res
        cap = res.shape[1]
        take = min(max(cap - self._seen, 0), m)
        res[:, self._seen:self._seen + take] = v[:, :take]
        self._seen += take
        for c0 in range(take, m, CHUNK_ELEMENTS):
            rest = v[:, c0:c0 + CHUNK_ELEMENTS]
            n = rest.shape[1]
            t = torch.arange(self._seen, self._seen + n, device=v.device, dtype=torch.float64)
            u = torch.rand(n, generator=self._gen, device=v.device, dtype=torch.float64)
            j = (u * (t + 1)).floor_().long()
            keep = torch.nonzero(j < cap).squeeze(1)
            winner = torch.full((cap,), -1, dtype=torch.long, device=v.device)
            winner.scatter_reduce_(0, j[keep], keep, reduce="amax")
            slots = torch.nonzero(winner >= 0).squeeze(1)
            res[:, slots] = rest[:, winner[slots]]
            self._seen += n

    def range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lo, hi)`` float32: shape ``[]`` per tensor, ``[C]`` per channel."""
        if self._lo is None or self._hi is None:
            raise MalformedInputError("no activation batch observed yet", tensor=self.name)
        if self.scheme.observer in ("minmax", "ema") or self._res is None:
            lo, hi = self._lo, self._hi
        else:
            filled = min(self._seen, self._res.shape[1])
            lo, hi = observe_range(self._res[:, :filled], self.scheme, name=self.name)
        return (lo, hi) if self.per_channel else (lo.squeeze(0), hi.squeeze(0))

    def qparams(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(scale, zero_point)`` of :meth:`range` by ``choose_qparams`` (zero point None if symmetric)."""
        lo, hi = self.range()
        return choose_qparams(lo, hi, dtype=self.scheme.dtype, symmetric=self.scheme.symmetric,
                              scale_dtype=self.scheme.scale_dtype)
