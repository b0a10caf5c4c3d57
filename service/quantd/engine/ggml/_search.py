"""ggml's k-quant scale searches, vectorised over every sub-block of a tensor at once.

Each search is a loop of ggml-quants.c (``make_qkx2_quants``/``make_qkx3_quants``, ``make_qx_quants``,
``make_q3_quants``, ``make_qp_quants``) with its body evaluated for all sub-blocks in one tensor op per
step: the Python loops run over candidate scales or over the positions of a sub-block, never over blocks
or rows. Sub-blocks are laid out element-major (``[n, S]``: ``x.T``), so a sum over a sub-block is ``n``
contiguous vector adds. Rounding is ggml's ``nearest_int`` (round half to even). Squared
errors of candidates come from the weighted sums the fit already has (Σw(sq + m − x)² expanded) rather
than another pass over the elements.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def _compiled_loop(name: str, fn: Callable[..., Any], key: tuple[Any, ...], args: tuple[Any, ...]
                   ) -> Iterator[Callable[..., Any] | None]:
    """A search's candidate step compiled for the loop over its candidates (``KERNELS.bound``), or None:
    the eager step (CUDA, small tensors, compiling off)."""
    if not wants_kernels(args[0]):
        yield None
        return
    with kernels.KERNELS.bound(name, fn, key, *args) as step_fn:
        yield step_fn


def _affine_codes_sums(xt: torch.Tensor, wt: torch.Tensor, wx: torch.Tensor, m: torch.Tensor, iscale: torch.Tensor,
                       nmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes ``q = clamp(nearest_int((x − m)·iscale), 0, nmax)`` of the columns of ``xt`` ``[n, S]`` and
    their sums ``(Σwq, Σwq², Σwxq)`` ``[S]``."""
    q = nearest_int((xt - m) * iscale).clamp(0, nmax)
    wq = wt * q
    return q, sum_rows(wq), sum_rows(wq * q), sum_rows(q * wx)


def _affine_error(xt: torch.Tensor, wt: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, m: torch.Tensor,
                  sums: tuple[torch.Tensor, ...], use_mad: bool) -> torch.Tensor:
    """The weighted error of ``x̂ = scale·q + m``: absolute (``use_mad``), or squared from the sums
    ``(Σw, Σwx, Σwx², Σwq, Σwq², Σwxq)`` (Σw(scale·q + m − x)² expanded)."""
    if use_mad:
        return sum_rows(wt * (scale * q + m - xt).abs())
    sum_w, sum_x, sum_x2, sum_l, sum_l2, sum_xl = sums
    return (scale * scale * sum_l2 + 2 * scale * m * sum_l - 2 * scale * sum_xl + m * m * sum_w
            - 2 * m * sum_x + sum_x2)


def affine_step(xt: torch.Tensor, wt: torch.Tensor, wx: torch.Tensor, stats: torch.Tensor, best: torch.Tensor,
                best_scale: torch.Tensor, best_min: torch.Tensor, factor: torch.Tensor, nmax: int, use_mad: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One candidate of ``make_qkx2_quants`` for every column of ``xt`` ``[n, S]``: ``iscale = factor /
    (max − best_min)``, its codes, the weighted least-squares scale and min (min clamped to ≤ 0), and the
    new best ``(error, scale, min)`` where it is lower. ``stats`` ``[4, S]``: ``Σw, Σwx, Σwx², max``.
    One compiled graph per candidate where the kernels run: a single pass over the elements."""
    sum_w, sum_x, sum_x2, mx = stats.unbind(0)
    rng = mx - best_min
    one = torch.ones_like(rng)
    iscale = factor / torch.where(rng > 0, rng, one)
    q, sum_l, sum_l2, sum_xl = _affine_codes_sums(xt, wt, wx, best_min, iscale, nmax)
    det = sum_w * sum_l2 - sum_l * sum_l
    ok = det > 0
    det = torch.where(ok, det, one)
    this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
    this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
    pos = this_min > 0
    this_min = torch.where(pos, torch.zeros_like(this_min), this_min)
    this_scale = torch.where(pos, sum_xl / _nonzero(sum_l2), this_scale)
    err = _affine_error(xt, wt, q, this_scale, this_min, (sum_w, sum_x, sum_x2, sum_l, sum_l2, sum_xl), use_mad)
    take = ok & (err < best)
    return torch.where(take, err, best), torch.where(take, this_scale, best_scale), torch.where(take, this_min, best_min)


def affine_search(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
                  use_mad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_qkx2_quants`` (``make_qkx3_quants`` differs only in its default weights) over the rows of ``x``
    ``[S, n]``: codes ``q ∈ [0, nmax]`` with ``x ≈ scale·q − the_min``. From the min-max grid, each candidate
    ``iscale = (rmin + rdelta·is + nmax) / (max − min)`` (relative to the best min so far, as in ggml) is
    rounded, scale and min fitted by weighted least squares (min clamped to ≤ 0), and the candidate of least
    weighted error kept (first on ties; ``use_mad``: absolute error). Returns ``(scale, the_min)`` ``[S]``;
    rows with ``max == min`` get scale 0."""
    xt = x.T.contiguous()
    wt = w.T.contiguous()
    wx = wt * xt
    mn = xt.amin(0).clamp(max=0)
    mx = xt.amax(0)
    flat = mx <= mn
    sum_w = sum_rows(wt)
    sum_x = sum_rows(wx)
    sum_x2 = sum_rows(wx * xt)
    iscale = nmax / torch.where(flat, torch.ones_like(mn), mx - mn)
    q, *sums = _affine_codes_sums(xt, wt, wx, mn, iscale, nmax)
    best_scale, best_min = 1 / iscale, mn
    best = _affine_error(xt, wt, q, best_scale, best_min, (sum_w, sum_x, sum_x2, *sums), use_mad)
    stats = torch.stack([sum_w, sum_x, sum_x2, mx])

    def args(step: int) -> tuple[Any, ...]:
        factor = torch.tensor(_f32(_f32(rmin + _f32(rdelta * step)) + nmax), device=x.device)
        return (xt, wt, wx, stats, best, best_scale, best_min, factor, nmax, use_mad)

    with _compiled_loop("ggml_affine_step", affine_step, (nmax, use_mad, xt.shape[0]), args(0)) as step_fn:
        for step in range(nstep + 1):
            a = args(step)
            out = None if step_fn is None else step_fn(*a)
            best, best_scale, best_min = affine_step(*a) if out is None else out
    return torch.where(flat, torch.zeros_like(best_scale), best_scale), torch.where(flat, -mn, -best_min)


def symmetric_step(xt: torch.Tensor, wt: torch.Tensor, wx: torch.Tensor, mxv: torch.Tensor, best: torch.Tensor,
                   scale: torch.Tensor, factor: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One candidate of ``make_qx_quants`` for every column of ``xt`` ``[n, S]``: codes of ``iscale =
    factor / max``, clamped to ``[−nmax, nmax − 1]``, and the new best ``(Σwxl)²/Σwl²`` and its scale
    ``Σwxl / Σwl²`` where it is higher (ggml's test ``sumlx² > best·suml2``)."""
    q = nearest_int(xt * (factor / mxv)).clamp(-nmax, nmax - 1)
    slx, sl2 = sum_rows(q * wx), sum_rows(wt * q * q)
    take = (sl2 > 0) & (slx * slx > best * sl2)
    scale = torch.where(take, slx / _nonzero(sl2), scale)
    return torch.where(take, scale * slx, best), scale


def symmetric_search(x: torch.Tensor, w: torch.Tensor, nmax: int) -> torch.Tensor:
    """``make_qx_quants(n, nmax, x, L, rmse_type=1, w)`` over the rows of ``x`` ``[S, n]``: codes
    ``l ∈ [−nmax, nmax − 1]`` with ``x ≈ scale·l``. Candidates ``iscale = −(nmax + 0.1·is) / max`` (``max``:
    the value of largest magnitude; is = −9…9), each with its weighted least-squares scale; the one
    maximising ``(Σwxl)² / Σwl²`` (least weighted error) wins. Returns ``scale`` ``[S]`` (0: all-zero rows)."""
    xt = x.T.contiguous()
    wt = w.T.contiguous()
    wx = wt * xt
    mxv = _signed_absmax(xt)
    zero = mxv.abs() < GROUP_MAX_EPS
    mxv = torch.where(zero, torch.ones_like(mxv), mxv)
    q = nearest_int(xt * (-nmax / mxv)).clamp(-nmax, nmax - 1)
    sumlx, suml2 = sum_rows(q * wx), sum_rows(wt * q * q)
    scale = torch.where(suml2 > 0, sumlx / _nonzero(suml2), torch.zeros_like(suml2))
    best = scale * sumlx

    def args(step: int) -> tuple[Any, ...]:
        factor = torch.tensor(-_f32(nmax + _f32(0.1 * step)), device=x.device)
        return (xt, wt, wx, mxv, best, scale, factor, nmax)

    with _compiled_loop("ggml_symmetric_step", symmetric_step, (nmax, xt.shape[0]), args(-9)) as step_fn:
        for step in range(-9, 10):
            if step == 0:
                continue
            a = args(step)
            out = None if step_fn is None else step_fn(*a)
            best, scale = symmetric_step(*a) if out is None else out
    return torch.where(zero, torch.zeros_like(scale), scale)


def descent_sweep(x_a: torch.Tensor, w_a: torch.Tensor, wx_a: torch.Tensor, q_a: torch.Tensor, slx_a: torch.Tensor,
                  sl2_a: torch.Tensor, lo: int | None, hi: int, need_sl2: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sweep of :func:`_coordinate_descent` over the ``n`` positions of the columns of ``[n, S]``: the
    new codes, ``Σwxq``, ``Σwq²`` and which columns changed. All element-wise across columns: compiled, one
    pass."""
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
        args = (x_a, w_a, wx_a, q_a, slx_a, sl2_a, lo, hi, need_sl2)
        out = None
        if wants_kernels(x_a):
            for t in args[:4]:
                torch._dynamo.mark_static(t, 0)  # the positions' loop unrolled in the graph
            out = kernels.KERNELS.call("ggml_descent_sweep", descent_sweep, (lo, hi, need_sl2, x_a.shape[0]), *args)
        q_a, slx_a, sl2_a, changed = descent_sweep(*args) if out is None else out
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


def q3_search(x: torch.Tensor, nmax: int) -> torch.Tensor:
    """``make_q3_quants(n, nmax, x, L, do_rmse=true)`` over the rows of ``x`` ``[S, n]``: codes from
    ``iscale = −nmax / max``, then up to 5 sweeps of coordinate descent, each position of every row moved
    to the code that the others' least-squares scale asks for when that raises ``(Σwxl)² / Σwl²``
    (``w = x²``). The sweep runs over the ``n`` positions, all rows at once. Returns ``scale`` ``[S]``."""
    xt = x.T.contiguous()
    wt = xt * xt
    mxv = _signed_absmax(xt)
    zero = mxv.abs() < GROUP_MAX_EPS
    mxv = torch.where(zero, torch.ones_like(mxv), mxv)
    q = nearest_int(xt * (-nmax / mxv)).clamp_(-nmax, nmax - 1)
    sumlx, suml2 = _coordinate_descent(xt, wt, q, -nmax, nmax - 1, need_sl2=False)
    scale = torch.where(suml2 > 0, sumlx / _nonzero(suml2), torch.zeros_like(suml2))
    return torch.where(zero, torch.zeros_like(scale), scale)


def qp_search(v: torch.Tensor, w: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_qp_quants(n, nmax, v, L, w)`` over the rows of ``v`` ``[NB, n]`` (non-negative sub-block
    scales or mins, weighted by their sub-blocks' total weight): integer ``L ∈ [0, nmax]`` and a scale with
    ``v ≈ scale·L``. The best of nine grids ``iscale = (nmax + 0.1·is) / max`` by weighted error, then up
    to 5 sweeps of coordinate descent over the positions. Returns ``(scale [NB], L [NB, n])``."""
    vt = v.T.contiguous()
    wt = w.T.contiguous()
    mx = vt.amax(0).clamp(min=0)
    zero = mx < GROUP_MAX_EPS
    mx = torch.where(zero, torch.ones_like(mx), mx)
    iscale = nmax / mx
    q = nearest_int(vt * iscale)
    best = sum_rows(wt * (vt - q / iscale) ** 2)
    for step in range(-4, 5):
        if step == 0:
            continue
        cand = _f32(_f32(0.1 * step) + nmax) / mx
        qc = nearest_int(vt * cand).clamp_(max=nmax)
        err = sum_rows(wt * (vt - qc / cand) ** 2)
        take = err < best
        best = torch.where(take, err, best)
        iscale = torch.where(take, cand, iscale)
    q = nearest_int(vt * iscale).clamp_(max=nmax)
    sumlx, suml2 = _coordinate_descent(vt, wt, q, None, nmax, need_sl2=True)
    scale = torch.where(suml2 > 0, sumlx / _nonzero(suml2), torch.zeros_like(suml2))
    q = torch.where(zero.unsqueeze(0), torch.zeros_like(q), q)
    return torch.where(zero, torch.zeros_like(scale), scale), q.T.clamp(min=0)
