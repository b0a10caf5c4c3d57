"""The ``mse`` observer: per block, the clip ratio of least ``Σ|x − x̂|ⁿ``, searched coarse to fine.

Eager, the candidate errors are computed in bounded ``[C, B, K]`` chunks; on CPU with the compiled kernels
on, each search step is one compiled graph whose error loop is ``engine.kernels.mse.candidate_error``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from quantd.engine.kernels import KERNELS
from quantd.engine.kernels.mse import NO_REALIZE, candidate_error, error_args, fix_block_length
from quantd.engine.kernels.quantize import FP8_TORCH_DTYPES
from quantd.engine.qparams import choose_qparams, divisor_tensor
from quantd_client import Scheme
from quantd_client._dtypes import NF4_CODEBOOK, DTypeInfo

from .base import register

# Elements of each of the two [candidates, rows, cols] temporaries of one eager mse chunk (1 MB: they stay in L2).
MSE_CHUNK_ELEMENTS = 1 << 18
# Blocks of at least 2·MSE_SAMPLE values are searched first on a strided sample: every
# min(MSE_SAMPLE_STRIDE, K // MSE_SAMPLE)-th value (≥ MSE_SAMPLE values: sparser samples miss the best clip of heavy tails).
MSE_SAMPLE = 256
MSE_SAMPLE_STRIDE = 4
# Entries of the [candidates, rows] arrays of one mse search step (qparams and errors float32, 4 MiB each; indices 8 MiB):
# fewer, larger steps, as each compiled call has a fixed cost.
MSE_QPARAM_ENTRIES = 1 << 20


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
    every dtype, within about 0.1 % of the exhaustive search's total error on Gaussian, heavy-tailed and
    real transformer weights. The best ratio evaluated anywhere wins, so the result is never worse than
    min-max.
    """
    coarse, spacing = coarse_grid(grid, points)
    stages: list[list[int]] = []
    reach = 2
    while spacing > 1:
        finer = max(1, round(spacing / 3))
        stages.append([k * finer for k in range(-reach, reach + 1) if k])
        reach, spacing = 1, finer
    return coarse, stages


def fake_quant_error(x: torch.Tensor, scale: torch.Tensor, inv: torch.Tensor, zp: torch.Tensor, info: DTypeInfo,
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
    if info.kind == "int":  # x · (1/s), not x / s: an estimate of the error, not the codes
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
        t = t.clamp_(-info.max_finite, info.max_finite).to(FP8_TORCH_DTYPES[dtype]).to(x.dtype).mul_(s)
    err: torch.Tensor = torch.linalg.vector_norm(t.sub_(xe), ord=norm, dim=-1)
    return err.square_() if norm == 2.0 else err.pow_(norm)


def _reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale``, finite: float32 and bfloat16 scales go down to 2⁻¹⁴⁹, whose reciprocal is inf (and
    0 · inf a NaN error for an all-zero block); the largest float32 instead gives ``x · (1/s)`` of 0."""
    return scale.reciprocal().clamp_(max=torch.finfo(torch.float32).max)


def _search_qparams(lo_r: torch.Tensor, hi_r: torch.Tensor, dtype: str, symmetric: bool,
                    scale_dtype: str, divisor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scale, its reciprocal and zero point (zeros when symmetric or not an integer dtype) of the
    candidate ranges ``(lo_r, hi_r)``, all float32: ``choose_qparams`` working in float32, whose scales
    may be an ulp of ``scale_dtype`` away from float64's (about 1 in 10⁴ candidates for float16/bfloat16
    scales). The search ranks its candidates on these, and the range it picks gets ``choose_qparams``'
    own qparams. Float32 is what keeps a search step's qparams cheap: they are computed for every
    candidate of every block."""
    scale, zp = choose_qparams(lo_r, hi_r, dtype=dtype, symmetric=symmetric, scale_dtype=scale_dtype,
                               work_dtype=torch.float32, divisor=divisor)
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
                      scale_dtype: str, divisor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    cols = []
    for c in range(offsets.shape[0]):  # C is static: compiled, one vectorised loop over the blocks per candidate
        idx = (b + offsets[c]).clamp(min=0).clamp(max=last)
        r = torch.where(idx == last, 1.0, start + idx.float() * step)
        cols.append((idx, *_search_qparams(lo * r, hi * r, dtype, symmetric, scale_dtype, divisor)))
    return tuple(torch.stack(col) for col in zip(*cols, strict=True))


def stage_candidates(lo: torch.Tensor, hi: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, grid: _Grid,
                     scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One search step's candidates, ``[C, B]`` each: the grid indices ``clamp(b + offsets, 0, G − 1)``
    around each block's best ``b[B]`` (``b = 0`` with the coarse indices as offsets for the first step),
    and the float32 scale, reciprocal and zero point of their ranges ``(r·lo, r·hi)``
    (:func:`_search_qparams`). Candidate-major: each candidate's values are one contiguous row, which
    the compiled step (:func:`search_step`) reads and writes as whole vectors (with a ``[B, C]`` layout
    its candidate and pick loops would be scalar code)."""
    idx, scale, inv, zp = _stage_candidates(lo, hi, b, offsets, grid.start, grid.step, grid.last, scheme.dtype,
                                            scheme.symmetric, scheme.scale_dtype,
                                            divisor_tensor(scheme.dtype, scheme.symmetric, lo.device))
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
                err[cs, rs] += fake_quant_error(x[rs, j:j + cols_c], scale[cs, rs], inv[cs, rs], zp[cs, rs], info,
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
          symmetric: bool, scale_dtype: str, divisor: torch.Tensor, qmin: torch.Tensor, qmax: torch.Tensor,
          kind: str, fp8: tuple[float, int, int], norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    idx, scale, inv, zp = _stage_candidates(lo, hi, b, offsets, start, step, last, dtype, symmetric, scale_dtype,
                                            divisor)
    err = candidate_error(x, scale, inv, zp, qmin, qmax, kind, fp8, norm)
    return pick_best(err, idx, b, e_best)


def _step_nf4(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return _step(*args)


def search_step(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                e_best: torch.Tensor, grid: _Grid, scheme: Scheme, info: DTypeInfo, norm: float, *,
                compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the mse search: the candidates around ``b`` (:func:`stage_candidates`), their errors
    and the new best (:func:`pick_best`). ``compiled``: one compiled graph, whose error loop is
    ``kernels.mse.candidate_error`` with no ``[C, B, K]`` temporary; otherwise, or when compiling is off, eager, with the chunked
    :func:`_candidate_errors`."""
    if compiled:
        # nf4: its own compiled function (and Dynamo's budget of variants), one variant per fixed block length
        name, fn, fixed = ("mse_step_nf4", _step_nf4, fix_block_length(x)) if info.kind == "nf4" else (
            "mse_step", _step, None)
        out = KERNELS.call(
            name, fn, (x.dtype, scheme.dtype, scheme.symmetric, scheme.scale_dtype, float(norm), fixed),
            x, lo, hi, b, offsets, e_best, grid.start, grid.step, grid.last, scheme.dtype, scheme.symmetric,
            scheme.scale_dtype, divisor_tensor(scheme.dtype, scheme.symmetric, x.device),
            *error_args(info, scheme.dtype, x.device), float(norm), options=NO_REALIZE)
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
    compiled = KERNELS.wants(x, small=True)
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


@register("mse")
def mse_range(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scheme: Scheme,
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
