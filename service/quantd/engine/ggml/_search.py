"""ggml's k-quant scale searches, vectorised over every sub-block of a tensor at once.

Each search is a loop of ggml-quants.c (``make_qkx2_quants``/``make_qkx3_quants``, ``make_qx_quants``,
``make_q3_quants``, ``make_qp_quants``) with its body evaluated for all sub-blocks in one tensor op per
step: the Python loops run over candidate scales or over the positions of a sub-block, never over blocks
or rows. Eager, sub-blocks are laid out element-major (``[n, S]``: ``x.T``), so a sum over a sub-block is
``n`` contiguous vector adds. Where the compiled kernels run, each search is instead one compiled call per
chunk with all its candidates or sweeps unrolled (:func:`_on_rows`). Rounding is ggml's ``nearest_int``
(round half to even). Squared
errors of candidates come from the weighted sums the fit already has (Σw(sq + m − x)² expanded) rather
than another pass over the elements.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from quantd.engine import kernels

from ._common import GROUP_MAX_EPS, nearest_int, sum_rows, wants_kernels


def _f32(v: float) -> float:
    """A constant as C computes it in float32 (``rmin + rdelta*is + nmax``)."""
    return float(torch.tensor(v, dtype=torch.float32))


def _nonzero(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v == 0, torch.ones_like(v), v)


def _signed_absmax(xt: torch.Tensor) -> torch.Tensor:
    """Per column of ``[n, S]``, the value of largest magnitude, the first on ties (``amax < fabsf(v)``)."""
    idx = xt.abs().argmax(dim=0, keepdim=True)
    return xt.gather(0, idx).squeeze(0)


def _on_rows(fn: Callable[..., Any], *rows: torch.Tensor, dim: int = 1) -> Any:
    """``fn(*rows)`` (a whole search) as one compiled call on contiguous copies, the sub-blocks' length (``dim``)
    static; None when it cannot run (the caller runs eager). The searches that reduce over a sub-block take
    one a row (``dim`` 1: the loops over a row vectorise). ``make_q3_quants``' descent, element-wise across
    sub-blocks, takes them as columns (``dim`` 0: a position's values side by side, so that the loop over
    sub-blocks vectorises; given a transposed view, Inductor reads it where it lies, element by element)."""
    rows = tuple(r.contiguous() for r in rows)
    for r in rows:
        torch._dynamo.mark_static(r, dim)
    return kernels.KERNELS.call(f"{fn.__name__}_{id(fn)}", fn, (rows[0].shape[dim],), *rows)


def _sum(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Σ over the elements of each sub-block: dim 0 of ``[n, S]`` (:func:`sum_rows`) or dim 1 of ``[S, n]``
    (kept, ``[S, 1]``)."""
    return sum_rows(t) if dim == 0 else t.sum(dim, keepdim=True)


def _affine_codes_sums(xt: torch.Tensor, wt: torch.Tensor, wx: torch.Tensor, m: torch.Tensor, iscale: torch.Tensor,
                       nmax: int, dim: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes ``q = clamp(nearest_int((x − m)·iscale), 0, nmax)`` of the sub-blocks of ``xt`` (their elements
    along ``dim``) and their sums ``(Σwq, Σwq², Σwxq)``."""
    q = nearest_int((xt - m) * iscale).clamp(0, nmax)
    wq = wt * q
    return q, _sum(wq, dim), _sum(wq * q, dim), _sum(q * wx, dim)


def _affine_error(xt: torch.Tensor, wt: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, m: torch.Tensor,
                  sums: tuple[torch.Tensor, ...], use_mad: bool, dim: int = 0) -> torch.Tensor:
    """The weighted error of ``x̂ = scale·q + m``: absolute (``use_mad``), or squared from the sums
    ``(Σw, Σwx, Σwx², Σwq, Σwq², Σwxq)`` (Σw(scale·q + m − x)² expanded)."""
    if use_mad:
        return _sum(wt * (scale * q + m - xt).abs(), dim)
    sum_w, sum_x, sum_x2, sum_l, sum_l2, sum_xl = sums
    return (scale * scale * sum_l2 + 2 * scale * m * sum_l - 2 * scale * sum_xl + m * m * sum_w
            - 2 * m * sum_x + sum_x2)


def _affine_candidate(xt: torch.Tensor, wt: torch.Tensor, wx: torch.Tensor, stats: tuple[torch.Tensor, ...],
                      best: torch.Tensor, best_scale: torch.Tensor, best_min: torch.Tensor, factor: torch.Tensor | float,
                      nmax: int, use_mad: bool, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One candidate of ``make_qkx2_quants`` for every sub-block: ``iscale = factor / (max − best_min)``, its
    codes, the weighted least-squares scale and min (min clamped to ≤ 0), and the new best ``(error, scale,
    min)`` where it is lower. ``stats``: ``Σw, Σwx, Σwx², max`` per sub-block."""
    sum_w, sum_x, sum_x2, mx = stats
    rng = mx - best_min
    one = torch.ones_like(rng)
    iscale = factor / torch.where(rng > 0, rng, one)
    q, sum_l, sum_l2, sum_xl = _affine_codes_sums(xt, wt, wx, best_min, iscale, nmax, dim)
    det = sum_w * sum_l2 - sum_l * sum_l
    ok = det > 0
    det = torch.where(ok, det, one)
    this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
    this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
    pos = this_min > 0
    this_min = torch.where(pos, torch.zeros_like(this_min), this_min)
    this_scale = torch.where(pos, sum_xl / _nonzero(sum_l2), this_scale)
    err = _affine_error(xt, wt, q, this_scale, this_min, (sum_w, sum_x, sum_x2, sum_l, sum_l2, sum_xl), use_mad,
                        dim)
    take = ok & (err < best)
    return torch.where(take, err, best), torch.where(take, this_scale, best_scale), torch.where(take, this_min, best_min)


def _affine_start(xt: torch.Tensor, wt: torch.Tensor, nmax: int, use_mad: bool, dim: int
                  ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                             torch.Tensor]:
    """The search's start on the sub-blocks of ``xt`` (elements along ``dim``): ``(Σw, Σwx, Σwx², max)``,
    ``w·x``, the min-max candidate's error, scale and min, and which sub-blocks are flat (``max == min``)."""
    wx = wt * xt
    mn = xt.amin(dim, keepdim=dim == 1).clamp(max=0)
    mx = xt.amax(dim, keepdim=dim == 1)
    flat = mx <= mn
    stats = (_sum(wt, dim), _sum(wx, dim), _sum(wx * xt, dim), mx)
    iscale = nmax / torch.where(flat, torch.ones_like(mn), mx - mn)
    q, *sums = _affine_codes_sums(xt, wt, wx, mn, iscale, nmax, dim)
    best = _affine_error(xt, wt, q, 1 / iscale, mn, (*stats[:3], *sums), use_mad, dim)
    return stats, wx, best, 1 / iscale, mn, flat


def _affine_factors(nmax: int, rmin: float, rdelta: float, nstep: int) -> tuple[float, ...]:
    """The candidates' ``rmin + rdelta·is + nmax``, is = 0…nstep, each as C computes it in float32."""
    return tuple(_f32(_f32(rmin + _f32(rdelta * step)) + nmax) for step in range(nstep + 1))


@functools.cache
def _affine_rows_fn(nmax: int, factors: tuple[float, ...], use_mad: bool) -> Callable[..., Any]:
    """The whole search on the rows of ``x`` ``[S, n]`` (one sub-block a row) as one function: what the
    compiled kernel fuses, every candidate unrolled. Row by row, a sub-block's elements stay in registers or
    L1 across its candidates; a kernel per candidate streams the chunk through the cache once per candidate,
    and takes about twice as long."""

    def ggml_affine_search(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        stats, wx, best, best_scale, best_min, flat = _affine_start(x, w, nmax, use_mad, 1)
        mn = best_min
        for factor in factors:
            best, best_scale, best_min = _affine_candidate(x, w, wx, stats, best, best_scale, best_min, factor, nmax,
                                                           use_mad, 1)
        scale = torch.where(flat, torch.zeros_like(best_scale), best_scale)
        return scale.squeeze(1), torch.where(flat, -mn, -best_min).squeeze(1)

    return ggml_affine_search


def affine_search(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
                  use_mad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_qkx2_quants`` (``make_qkx3_quants`` differs only in its default weights) over the rows of ``x``
    ``[S, n]``: codes ``q ∈ [0, nmax]`` with ``x ≈ scale·q − the_min``. From the min-max grid, each candidate
    ``iscale = (rmin + rdelta·is + nmax) / (max − min)`` (relative to the best min so far, as in ggml) is
    rounded, scale and min fitted by weighted least squares (min clamped to ≤ 0), and the candidate of least
    weighted error kept (first on ties; ``use_mad``: absolute error). Returns ``(scale, the_min)`` ``[S]``;
    rows with ``max == min`` get scale 0.

    Where the kernels run, the whole search is one compiled call on the rows (:func:`_affine_rows_fn`);
    eager, it runs on the columns of ``x.T`` (a sum over a sub-block is then ``n`` contiguous vector adds),
    one set of ops per candidate."""
    factors = _affine_factors(nmax, rmin, rdelta, nstep)
    if wants_kernels(x) and (out := _on_rows(_affine_rows_fn(nmax, factors, use_mad), x, w)) is not None:
        return out  # type: ignore[no-any-return]
    xt = x.T.contiguous()
    wt = w.T.contiguous()
    stats, wx, best, best_scale, best_min, flat = _affine_start(xt, wt, nmax, use_mad, 0)
    mn = best_min
    for factor in factors:
        best, best_scale, best_min = _affine_candidate(xt, wt, wx, stats, best, best_scale, best_min,
                                                       torch.tensor(factor, device=x.device), nmax, use_mad, 0)
    return torch.where(flat, torch.zeros_like(best_scale), best_scale), torch.where(flat, -mn, -best_min)


def _symmetric_candidate(xt: torch.Tensor, wt: torch.Tensor, wx: torch.Tensor, mxv: torch.Tensor, best: torch.Tensor,
                         scale: torch.Tensor, factor: torch.Tensor | float, nmax: int, dim: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """One candidate of ``make_qx_quants`` for every sub-block (elements along ``dim``): codes of ``iscale =
    factor / max``, clamped to ``[−nmax, nmax − 1]``, and the new best ``(Σwxl)²/Σwl²`` and its scale
    ``Σwxl / Σwl²`` where it is higher (ggml's test ``sumlx² > best·suml2``)."""
    q = nearest_int(xt * (factor / mxv)).clamp(-nmax, nmax - 1)
    slx, sl2 = _sum(q * wx, dim), _sum(wt * q * q, dim)
    take = (sl2 > 0) & (slx * slx > best * sl2)
    scale = torch.where(take, slx / _nonzero(sl2), scale)
    return torch.where(take, scale * slx, best), scale


def _symmetric_start(xt: torch.Tensor, wt: torch.Tensor, nmax: int, dim: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w·x``, the value of largest magnitude (1 where all are zero), which sub-blocks are all zero, and the
    first candidate's ``(Σwxl)²/Σwl²`` and scale (``iscale = −nmax / max``)."""
    wx = wt * xt
    idx = xt.abs().argmax(dim=dim, keepdim=True)  # the first of the largest magnitudes (ggml: amax < fabsf(v))
    mxv = xt.gather(dim, idx)
    if dim == 0:
        mxv = mxv.squeeze(0)
    zero = mxv.abs() < GROUP_MAX_EPS
    mxv = torch.where(zero, torch.ones_like(mxv), mxv)
    q = nearest_int(xt * (-nmax / mxv)).clamp(-nmax, nmax - 1)
    sumlx, suml2 = _sum(q * wx, dim), _sum(wt * q * q, dim)
    scale = torch.where(suml2 > 0, sumlx / _nonzero(suml2), torch.zeros_like(suml2))
    return wx, mxv, zero, scale * sumlx, scale


# make_qx_quants' candidates: iscale = −(nmax + 0.1·is) / max, is = −9…9 but 0 (the start)
_SYMMETRIC_STEPS = tuple(step for step in range(-9, 10) if step != 0)


@functools.cache
def _symmetric_rows_fn(nmax: int) -> Callable[..., Any]:
    """The whole :func:`symmetric_search` on the rows of ``x`` ``[S, n]`` as one function (the compiled
    kernel; see :func:`_affine_rows_fn`)."""
    factors = tuple(-_f32(nmax + _f32(0.1 * step)) for step in _SYMMETRIC_STEPS)

    def ggml_symmetric_search(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        wx, mxv, zero, best, scale = _symmetric_start(x, w, nmax, 1)
        for factor in factors:
            best, scale = _symmetric_candidate(x, w, wx, mxv, best, scale, factor, nmax, 1)
        return torch.where(zero, torch.zeros_like(scale), scale).squeeze(1)

    return ggml_symmetric_search


def symmetric_search(x: torch.Tensor, w: torch.Tensor, nmax: int) -> torch.Tensor:
    """``make_qx_quants(n, nmax, x, L, rmse_type=1, w)`` over the rows of ``x`` ``[S, n]``: codes
    ``l ∈ [−nmax, nmax − 1]`` with ``x ≈ scale·l``. Candidates ``iscale = −(nmax + 0.1·is) / max`` (``max``:
    the value of largest magnitude; is = −9…9), each with its weighted least-squares scale; the one
    maximising ``(Σwxl)² / Σwl²`` (least weighted error) wins. Returns ``scale`` ``[S]`` (0: all-zero rows).
    Compiled, one call on the rows; eager, one set of ops per candidate on the columns of ``x.T``."""
    if wants_kernels(x) and (out := _on_rows(_symmetric_rows_fn(nmax), x, w)) is not None:
        return out  # type: ignore[no-any-return]
    xt = x.T.contiguous()
    wt = w.T.contiguous()
    wx, mxv, zero, best, scale = _symmetric_start(xt, wt, nmax, 0)
    for step in _SYMMETRIC_STEPS:
        factor = torch.tensor(-_f32(nmax + _f32(0.1 * step)), device=x.device)
        best, scale = _symmetric_candidate(xt, wt, wx, mxv, best, scale, factor, nmax, 0)
    return torch.where(zero, torch.zeros_like(scale), scale)


def descent_sweep(x_a: torch.Tensor, w_a: torch.Tensor, wx_a: torch.Tensor, q_a: torch.Tensor, slx_a: torch.Tensor,
                  sl2_a: torch.Tensor, lo: int | None, hi: int, need_sl2: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sweep of :func:`_coordinate_descent` over the ``n`` positions of the columns of ``[n, S]``: the
    new codes, ``Σwxq``, ``Σwq²`` and which columns changed. All element-wise across columns (in the compiled
    searches, one pass)."""
    changed = torch.zeros_like(slx_a, dtype=torch.bool)
    rows = []
    for i in range(x_a.shape[0]):
        wi, xi, li, wxi = w_a[i], x_a[i], q_a[i], wx_a[i]
        slx = slx_a - wxi * li
        sl2 = sl2_a - wi * li * li
        new_l = nearest_int(xi * sl2 / _nonzero(slx))
        new_l = new_l.clamp(max=hi) if lo is None else new_l.clamp(lo, hi)
        slx_n = slx + wxi * new_l
        sl2_n = sl2 + wi * new_l * new_l
        take = (slx > 0) & (new_l != li) & (slx_n * slx_n * sl2_a > slx_a * slx_a * sl2_n)
        take = take & ((sl2 > 0) if need_sl2 else (sl2_n > 0))
        rows.append(torch.where(take, new_l, li))
        slx_a = torch.where(take, slx_n, slx_a)
        sl2_a = torch.where(take, sl2_n, sl2_a)
        changed = changed | take
    return torch.stack(rows), slx_a, sl2_a, changed


def _coordinate_descent(xt: torch.Tensor, wt: torch.Tensor, q: torch.Tensor, lo: int | None, hi: int, *,
                        need_sl2: bool, sweeps: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's refinement of integer codes ``q`` ``[n, S]`` (in place) for ``x ≈ scale·q`` per column: up to
    ``sweeps`` passes over the ``n`` positions, each code moved to the one the others' least-squares scale
    asks for when that raises ``(Σwxq)² / Σwq²``. Returns ``(Σwxq, Σwq²)`` ``[S]``. ``need_sl2``:
    ``make_qp_quants``' test (the others' ``Σwq² > 0`` before the move) rather than ``make_q3_quants``' (after).

    A column that changed nothing in a sweep would change nothing in the next (its state is the same), which
    is where ggml stops it; later sweeps run on the columns that changed in the previous one only."""
    wx = wt * xt
    sumlx = sum_rows(wx * q)
    suml2 = sum_rows(wt * q * q)
    cols: torch.Tensor | None = None  # the columns still moving (None: all)
    x_a, w_a, wx_a, q_a, slx_a, sl2_a = xt, wt, wx, q, sumlx, suml2
    for _ in range(sweeps):
        q_a, slx_a, sl2_a, changed = descent_sweep(x_a, w_a, wx_a, q_a, slx_a, sl2_a, lo, hi, need_sl2)
        if cols is None:
            q.copy_(q_a)
            sumlx, suml2 = slx_a, sl2_a
        else:
            q[:, cols] = q_a
            sumlx[cols] = slx_a
            suml2[cols] = sl2_a
        moving = changed.nonzero().squeeze(1)
        if moving.numel() == 0:
            break
        cols = moving if cols is None else cols[moving]
        x_a, w_a, wx_a, q_a = x_a[:, moving], w_a[:, moving], wx_a[:, moving], q_a[:, moving]
        slx_a, sl2_a = slx_a[moving], sl2_a[moving]
    return sumlx, suml2


def _q3_start(xt: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_q3_quants``' start on the columns of ``xt`` ``[n, S]``: the codes of ``iscale = −nmax / max``,
    and which columns are all zero."""
    mxv = _signed_absmax(xt)
    zero = mxv.abs() < GROUP_MAX_EPS
    mxv = torch.where(zero, torch.ones_like(mxv), mxv)
    return nearest_int(xt * (-nmax / mxv)).clamp(-nmax, nmax - 1), zero


def _q3_scale(sumlx: torch.Tensor, suml2: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    scale = torch.where(suml2 > 0, sumlx / _nonzero(suml2), torch.zeros_like(suml2))
    return torch.where(zero, torch.zeros_like(scale), scale)


@functools.cache
def _q3_fn(nmax: int, sweeps: int = 5) -> Callable[..., Any]:
    """The whole :func:`q3_search` as one function (the compiled kernel): every sweep on every column, which
    gives the eager search's result (see :func:`_qp_fn`). The sweeps are element-wise across columns, so the
    kernel is one pass over the sub-blocks with each one's codes and sums in registers."""

    def ggml_q3_search(xt: torch.Tensor) -> torch.Tensor:  # [n, S]: a position's values side by side
        wt = xt * xt
        q, zero = _q3_start(xt, nmax)
        wx = wt * xt
        slx, sl2 = (wx * q).sum(0), (wt * q * q).sum(0)
        for _ in range(sweeps):
            q, slx, sl2, _ = descent_sweep(xt, wt, wx, q, slx, sl2, -nmax, nmax - 1, False)
        return _q3_scale(slx, sl2, zero)

    return ggml_q3_search


def q3_search(x: torch.Tensor, nmax: int) -> torch.Tensor:
    """``make_q3_quants(n, nmax, x, L, do_rmse=true)`` over the rows of ``x`` ``[S, n]``: codes from
    ``iscale = −nmax / max``, then up to 5 sweeps of coordinate descent, each position of every row moved
    to the code that the others' least-squares scale asks for when that raises ``(Σwxl)² / Σwl²``
    (``w = x²``). The sweep runs over the ``n`` positions, all rows at once. Returns ``scale`` ``[S]``.
    Compiled, one call."""
    if wants_kernels(x) and (out := _on_rows(_q3_fn(nmax), x.T, dim=0)) is not None:
        return out  # type: ignore[no-any-return]
    xt = x.T.contiguous()
    wt = xt * xt
    q, zero = _q3_start(xt, nmax)
    sumlx, suml2 = _coordinate_descent(xt, wt, q, -nmax, nmax - 1, need_sl2=False)
    return _q3_scale(sumlx, suml2, zero)


@functools.cache
def _qp_factors(nmax: int) -> tuple[float, ...]:
    """``make_qp_quants``' grid factors ``nmax + 0.1·is``, is = −4…4 but 0, each as C computes it in float32
    (computed before tracing: a tensor made inside a compiled function keeps it out of the compiler's cache
    of traced graphs, and every new process would trace it again)."""
    return tuple(_f32(_f32(0.1 * step) + nmax) for step in range(-4, 5) if step != 0)


def _qp_grid(vt: torch.Tensor, wt: torch.Tensor, nmax: int, factors: tuple[float, ...]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_qp_quants``' grid on the columns of ``vt`` ``[n, R]``: the codes of the best of nine
    ``iscale = (nmax + 0.1·is) / max`` by weighted error (``factors``: :func:`_qp_factors`), and which columns
    are all zero."""
    mx = vt.amax(0).clamp(min=0)
    zero = mx < GROUP_MAX_EPS
    mx = torch.where(zero, torch.ones_like(mx), mx)
    iscale = nmax / mx
    q = nearest_int(vt * iscale)
    best = sum_rows(wt * (vt - q / iscale) ** 2)
    for factor in factors:
        cand = factor / mx
        qc = nearest_int(vt * cand).clamp(max=nmax)
        err = sum_rows(wt * (vt - qc / cand) ** 2)
        take = err < best
        best = torch.where(take, err, best)
        iscale = torch.where(take, cand, iscale)
    return nearest_int(vt * iscale).clamp(max=nmax), zero


def _qp_result(q: torch.Tensor, sumlx: torch.Tensor, suml2: torch.Tensor, zero: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    scale = torch.where(suml2 > 0, sumlx / _nonzero(suml2), torch.zeros_like(suml2))
    q = torch.where(zero.unsqueeze(0), torch.zeros_like(q), q)
    return torch.where(zero, torch.zeros_like(scale), scale), q.T.clamp(min=0)


@functools.cache
def _qp_fn(nmax: int, sweeps: int = 5) -> Callable[..., Any]:
    """The whole :func:`qp_search` as one function (the compiled kernel): the grid, then every sweep on
    every column. A column that changed nothing in a sweep changes nothing in the next, so this gives the
    eager search's result, which sweeps only the columns still moving."""
    factors = _qp_factors(nmax)

    def ggml_qp_search(v: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vt, wt = v.t(), w.t()
        q, zero = _qp_grid(vt, wt, nmax, factors)
        wx = wt * vt
        slx, sl2 = (wx * q).sum(0), (wt * q * q).sum(0)
        for _ in range(sweeps):
            q, slx, sl2, _ = descent_sweep(vt, wt, wx, q, slx, sl2, None, nmax, True)
        return _qp_result(q, slx, sl2, zero)

    return ggml_qp_search


def qp_search(v: torch.Tensor, w: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_qp_quants(n, nmax, v, L, w)`` over the rows of ``v`` ``[NB, n]`` (non-negative sub-block
    scales or mins, weighted by their sub-blocks' total weight): integer ``L ∈ [0, nmax]`` and a scale with
    ``v ≈ scale·L``. The best of nine grids ``iscale = (nmax + 0.1·is) / max`` by weighted error, then up
    to 5 sweeps of coordinate descent over the positions. Returns ``(scale [NB], L [NB, n])``. A few hundred
    ops on a 32nd of the chunk: compiled, one call."""
    if wants_kernels(v) and (out := _on_rows(_qp_fn(nmax), v, w)) is not None:
        return out  # type: ignore[no-any-return]
    vt = v.T.contiguous()
    wt = w.T.contiguous()
    q, zero = _qp_grid(vt, wt, nmax, _qp_factors(nmax))
    sumlx, suml2 = _coordinate_descent(vt, wt, q, None, nmax, need_sl2=True)
    return _qp_result(q, sumlx, suml2, zero)
