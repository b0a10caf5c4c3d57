"""The ``entropy`` observer: the KL-divergence calibration of TensorRT / ONNX Runtime, batched over blocks."""

from __future__ import annotations

import torch

from quantd_client import Scheme
from quantd_client._dtypes import DTypeInfo

from .base import CHUNK_ELEMENTS, register
from .mse import coarse_grid

# Thresholds tried per block by the entropy observer (evenly spaced window widths, both ends included).
ENTROPY_MAX_CANDIDATES = 128
# Histogram entries (int64) the entropy observer holds at once: blocks are calibrated in chunks of this many
# blocks × bins (32 MiB).
ENTROPY_HIST_ENTRIES = 1 << 22
# Blocks of fewer values keep their min-max range under the entropy observer: a histogram of a handful of
# values has no tail to clip, and its cost (∝ blocks · candidates · bins, at least 2·quant_bins bins) per
# value would be hundreds of times min-max's.
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
    # Divided by a tensor, not the number: CUDA divides by a number as a multiplication by its reciprocal.
    start = (zero_pos * (1.0 - widths.float() / torch.full((), float(nbins), device=hist.device))).round().long()
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


@register("entropy")
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
    bin_w = (b - a) / torch.full((), float(nbins), dtype=b.dtype, device=b.device)  # (see _entropy_kl)
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
