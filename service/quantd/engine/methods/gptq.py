"""GPTQ: columns quantized one after another, each one's error spread onto the columns not yet quantized
through the inverse Hessian of the layer's inputs (Frantar et al., 2022).

With ``H = Σ x xᵀ / N + λ·mean(diag H)·I`` and ``U`` the upper Cholesky factor of ``H⁻¹``, column ``j``:
``q_j = Q(w_j)``, ``e_j = (w_j − q_j) / U_jj``, ``W[:, k] −= e_j · U_jk`` for the later columns ``k``. The
update is applied inside a block of columns right away and to the columns after the block in one matmul
at its end (lazy batch updates). The loop over columns is the method itself (each column depends on the
last); every step is vectorised over the rows. The damping ``λ`` (``damp``, 0.1 by default where the paper
takes 0.01) keeps GPTQ from fitting the sampling noise of an ``H`` estimated from a few thousand rows (a
lower error on the calibration rows, a higher one on other inputs); ``diag_damp`` can instead shrink ``H``
towards its diagonal, ``H_jj ← (1 + diag_damp·√(in / N))·H_jj``. With groups, each group's scale and
zero point come from the scheme's observer on the group's columns as they are when the group is reached
(their earlier updates included), the range shrunk (by up to ``max_shrink``, ``clip_grid`` candidates) to
the least rounding error weighted by ``diag H``. ``act_order`` visits columns by decreasing
``diag H``; the groups then follow that order and ``g_idx`` maps each column to its group, unless
``static_groups`` fixes every group's parameters on the original weight first (groups stay contiguous, no
``g_idx``). Dead inputs (``H_jj = 0``) get zero weights, as in the reference implementations.
``refit_scale`` then refits each row's group scales, the codes fixed, by least squares against the damped
``H``: the scales that GPTQ's own objective prefers for the codes it chose (the zero points stay integers, as
stored). ``awq_scales`` first scales the input channels as AWQ does (:mod:`quantd.engine.methods.awq`, searched
against the damped ``H``), stored as ``channel_scale``. Memory: a few ``[in, in]`` and ``[out, in]``
float32 matrices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from quantd.engine.observers import observe_range
from quantd.engine.qparams import choose_qparams, scale_torch_dtype
from quantd.engine.types import QuantizedTensor
from quantd.errors import ConfigError, MalformedInputError
from quantd_client import Scheme
from quantd_client._dtypes import DTypeInfo, dtype_info

from ._common import check_linear_weight, encode, group_columns
from .awq import awq_scales
from .base import Arg, LayerHessian, Method, register


def inverse_hessian_factor(h: torch.Tensor, *, damp: float, name: str) -> torch.Tensor:
    """The upper Cholesky factor ``U`` of ``(H + damp·mean(diag H)·I)⁻¹`` (``H⁻¹ = Uᵀ U``), on ``h``'s device.

    With ``J`` the reversal permutation and ``J H J = L Lᵀ``: ``H = R Rᵀ`` for the upper ``R = J L J``, so
    ``H⁻¹ = (R⁻¹)ᵀ R⁻¹`` and ``U = R⁻¹ = J L⁻¹ J``: one Cholesky and one triangular solve, no explicit
    inverse. The damping grows tenfold (up to four times) while ``H`` is not positive definite in float32."""
    eye = torch.eye(h.shape[0], device=h.device, dtype=h.dtype)
    mean_diag = float(torch.diagonal(h).mean())
    flipped = h.flip(0, 1)
    lam = damp
    for _ in range(5):
        chol, info = torch.linalg.cholesky_ex(flipped + lam * mean_diag * eye)
        if int(info) == 0:
            inv = torch.linalg.solve_triangular(chol, eye, upper=False)
            upper: torch.Tensor = inv.flip(0, 1)
            if bool(torch.isfinite(upper).all()):
                return upper
        lam *= 10.0
    raise MalformedInputError(f"tensor {name!r}: the calibration Hessian is not positive definite even with "
                              f"damping {lam / 10:g}", tensor=name)


def _qparams(w: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row float32 scale and zero point columns ``[rows, 1]`` of the block ``w[rows, k]``."""
    lo, hi = observe_range(w, scheme)
    scale, zp = choose_qparams(lo, hi, dtype=scheme.dtype, symmetric=scheme.symmetric,
                               scale_dtype=scheme.scale_dtype)
    return scale.float().unsqueeze(1), None if zp is None else zp.float().unsqueeze(1)


# Elements of ``w`` times candidates the range search evaluates at once (its few temporaries stay ~16 MiB).
_SEARCH_ELEMENTS = 1 << 22


def _qparams_searched(w: torch.Tensor, importance: torch.Tensor, scheme: Scheme, info: DTypeInfo,
                      ratios: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As :func:`_qparams`, each row's range shrunk by the ratio whose rounding error ``d`` of the block
    ``w[rows, k]`` has the least ``Σ_j h_j d_j²``, ``h = importance[rows or 1, k]`` the inputs' energy per
    column (``diag H``): the layer's output error without the cross terms, which a few thousand calibration
    rows estimate poorly."""
    lo, hi = observe_range(w, scheme)
    best_s = best_z = None
    best_err = torch.full((w.shape[0], 1), float("inf"), device=w.device)
    ratios = ratios.to(device=w.device, dtype=torch.float32)
    per_pass = max(1, _SEARCH_ELEMENTS // max(w.numel(), 1))  # candidates side by side, memory bounded
    for c0 in range(0, ratios.numel(), per_pass):
        r = ratios[c0:c0 + per_pass].view(-1, 1)
        scale, zp = choose_qparams(lo * r, hi * r, dtype=scheme.dtype, symmetric=scheme.symmetric,
                                   scale_dtype=scheme.scale_dtype)
        s = scale.float().unsqueeze(2)  # [C, rows, 1]
        z = None if zp is None else zp.float().unsqueeze(2)
        code = encode(w, s, z, info)
        d = (code if z is None else code - z) * s - w
        err = (d * d * importance).sum(dim=2, keepdim=True)
        pick = err.argmin(dim=0, keepdim=True)  # the first of equal errors: the widest range
        err, s = err.gather(0, pick)[0], s.gather(0, pick)[0]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = s if best_s is None else torch.where(better, s, best_s)
        if z is not None:
            z = z.gather(0, pick)[0]
            best_z = z if best_z is None else torch.where(better, z, best_z)
    if best_s is None:
        raise ValueError("no clipping ratio to search")
    return best_s, best_z


# Elements of the per-row normal equations ``[rows, G, G]`` the scale refit builds and solves at once.
_REFIT_ELEMENTS = 1 << 23
# Above this many groups a row (in > 32768 at g128, > 16384 at g64), the refit is skipped: its ``[G, G]`` systems
# leave room for few rows a chunk, and each chunk runs G small matmuls, so the Python loop grows as rows·G³ while
# the arithmetic stays rows·in²/2.
REFIT_MAX_GROUPS = 256


def refit_group_scales(w: torch.Tensor, h: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, gs: int,
                       scale_dtype: torch.dtype) -> torch.Tensor:
    """Each row's group scales ``a`` that minimise ``(w − ŵ) H (w − ŵ)ᵀ`` for ``ŵ_j = a_g(j) · q_j``, with the
    codes ``q = code − zero`` fixed and the groups contiguous: per row the normal equations ``M a = b``,
    ``M_gh = q_gᵀ H_gh q_h`` and ``b_g = q_gᵀ (H w)_g``, one ``[G, G]`` system per row, all rows at once.
    ``M`` is built group by group, one matmul ``q_g H_g·`` each for its upper triangle (``rows·in²/2``
    multiply-adds in all, as GPTQ's own updates), in row chunks so that memory stays a few ``[rows, in]``
    blocks. A group keeps its old scale where the new one, rounded to ``scale_dtype``, is not positive and
    finite, and a row keeps all of its old scales unless the new ones lower its objective ``aᵀ M a − 2 aᵀ b``."""
    rows, cols = w.shape
    n_groups = cols // gs
    hw = w @ h
    qb = (q * hw).view(rows, n_groups, gs).sum(2)
    per_chunk = max(1, _REFIT_ELEMENTS // max(n_groups * n_groups, cols))
    out = scale.clone()
    for r0 in range(0, rows, per_chunk):
        r1 = min(r0 + per_chunk, rows)
        qc = q[r0:r1]
        m = torch.empty(r1 - r0, n_groups, n_groups, device=w.device, dtype=w.dtype)
        for g in range(n_groups):  # the upper triangle ``h ≥ g``; M is symmetric
            c0 = g * gs
            t = qc[:, c0:c0 + gs] @ h[c0:c0 + gs, c0:]
            m[:, g, g:] = (t * qc[:, c0:]).view(r1 - r0, n_groups - g, gs).sum(2)
            m[:, g + 1:, g] = m[:, g, g + 1:]
        b = qb[r0:r1]
        ridge = 1e-6 * torch.diagonal(m, dim1=1, dim2=2).mean(1).clamp_min(torch.finfo(w.dtype).tiny)
        chol, info = torch.linalg.cholesky_ex(m + torch.diag_embed(ridge.unsqueeze(1).expand(-1, n_groups)))
        a = torch.cholesky_solve(b.unsqueeze(2), chol)[..., 0].to(scale_dtype).to(w.dtype)
        old = scale[r0:r1]

        def objective(x: torch.Tensor, m: torch.Tensor = m, b: torch.Tensor = b) -> torch.Tensor:
            return (torch.einsum("rg,rgh,rh->r", x, m, x) - 2.0 * (x * b).sum(1))

        ok = (info == 0).unsqueeze(1) & torch.isfinite(a) & (a > 0)
        a = torch.where(ok, a, old)
        keep = objective(a) < objective(old)
        out[r0:r1] = torch.where(keep.unsqueeze(1), a, old)
    return out


def gptq(w: torch.Tensor, h: torch.Tensor, scheme: Scheme, info: DTypeInfo, *, damp: float, block_size: int,
         act_order: bool, static_groups: bool, name: str, clip_grid: int = 0, max_shrink: float = 0.0,
         refit_scale: bool = False
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Codes ``[out, in]`` (float32 integers, original column order), scale and zero point ``[out, G]``
    (float32), and ``g_idx`` (None when the groups are the contiguous ones)."""
    w = w.float().clone()
    h = h.float().clone()
    rows, cols = w.shape
    gs = group_columns(cols, scheme)
    n_groups = cols // gs
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    ratios = None
    if clip_grid > 0 and max_shrink > 0:
        ratios = 1.0 - torch.arange(max(1, int(max_shrink * clip_grid))) / clip_grid
    static = None
    if static_groups or scheme.granularity == "channel":  # every group's parameters from the weight up front
        blocks = w.reshape(rows * n_groups, gs)
        if ratios is None:
            s, z = _qparams(blocks, scheme)
        else:
            importance = torch.diagonal(h).reshape(1, n_groups, gs).expand(rows, -1, -1).reshape(-1, gs)
            s, z = _qparams_searched(blocks, importance, scheme, info, ratios)
        static = (s.reshape(rows, n_groups), None if z is None else z.reshape(rows, n_groups))
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else None
    if perm is not None:
        w, h = w[:, perm], h[perm][:, perm]
    u = inverse_hessian_factor(h, damp=damp, name=name)
    hdiag = torch.diagonal(h)
    scale = torch.empty(rows, n_groups, device=w.device)
    zero = None if scheme.symmetric else torch.empty(rows, n_groups, device=w.device)
    # the column's group: its own (static) or the position it is visited at (dynamic)
    col_group = (torch.arange(cols, device=w.device) // gs) if perm is None or static is None else perm // gs
    if static is not None:
        scale.copy_(static[0])
        if zero is not None and static[1] is not None:
            zero.copy_(static[1])
    # Columns as contiguous rows of the transposed weight. Each column is rounded as ``code − z =
    # clamp(round(w / s), qmin − z, qmax − z)`` (the encode with an integer zero point, exactly): the
    # zero point is added back once at the end, and each column costs a handful of vector operations.
    wt = w.T.contiguous()
    qt = torch.empty_like(wt)
    bs = max(gs if static is None else 1, (block_size // gs) * gs if static is None else block_size)
    for b0 in range(0, cols, bs):
        b1 = min(b0 + bs, cols)
        w1 = wt[b0:b1]  # updated in place: column i is final when it is reached
        err = torch.empty_like(w1)
        u1 = u[b0:b1, b0:b1]
        u_diag = torch.diagonal(u1)
        if static is not None:  # every column's parameters at once, from its (fixed) group
            s_blk = scale[:, col_group[b0:b1]].T.contiguous()
            lo_blk, hi_blk = _code_bounds(None if zero is None else zero[:, col_group[b0:b1]].T, info, s_blk)
        for i in range(b1 - b0):  # column by column: each one's rounding depends on the previous ones' errors
            j = b0 + i
            if static is None:
                if j % gs == 0:  # a new group starts: its parameters from its columns as they are
                    block = w1[i:i + gs].T
                    if ratios is None:
                        sg, zg = _qparams(block, scheme)
                    else:
                        sg, zg = _qparams_searched(block, hdiag[j:j + gs].unsqueeze(0), scheme, info, ratios)
                    scale[:, j // gs] = sg[:, 0]
                    if zero is not None and zg is not None:
                        zero[:, j // gs] = zg[:, 0]
                    s_col = sg[:, 0]
                    lo, hi = _code_bounds(None if zg is None else zg[:, 0], info, s_col)
            else:
                s_col, lo, hi = s_blk[i], lo_blk[i], hi_blk[i]
            col = w1[i]
            code = torch.round(col / s_col).clamp_(lo, hi)
            qt[j] = code
            e = torch.addcmul(col, code, s_col, value=-1.0, out=err[i]).div_(u_diag[i])
            w1[i + 1:].addr_(u1[i, i + 1:], e, alpha=-1.0)
        wt[b1:].addmm_(u[b0:b1, b1:].T, err, alpha=-1.0)
    q = qt.T
    if refit_scale and n_groups <= REFIT_MAX_GROUPS:  # on columns ordered so that each group is contiguous
        order = torch.argsort(col_group, stable=True) if perm is not None and static is not None else None
        lam = damp * float(hdiag.mean())
        # h is this function's own copy, not read after this: damped in place (visit order for dynamic groups)
        hd = h if order is None else h[order.unsqueeze(1), order]
        hd.diagonal().add_(lam)
        wq, qq = (w, qt.T) if order is None else (w[:, order], qt.T[:, order])
        scale = refit_group_scales(wq, hd, qq, scale, gs, scale_torch_dtype(scheme.scale_dtype))
        del hd
    if zero is not None:
        q = q + zero[:, col_group]
    g_idx = None
    if perm is not None:
        inv = torch.argsort(perm)
        q = q[:, inv]
        if static is None:
            g_idx = (inv // gs).to(torch.int32)
    return q.contiguous(), scale, zero, g_idx


def _code_bounds(zero: torch.Tensor | None, info: DTypeInfo, like: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``qmin − z`` and ``qmax − z`` shaped as ``like`` (``z = 0`` when symmetric)."""
    if zero is None:
        return torch.full_like(like, info.qmin), torch.full_like(like, info.qmax)
    return info.qmin - zero, info.qmax - zero


def diag_shrink_ratio(diag_damp: float, *, cols: int, rows: int) -> float:
    """``diag_damp · √(cols / rows)``: how much each ``H_jj`` grows (relative to itself). The sampling noise of
    ``H``'s off-diagonal terms estimated from ``rows`` inputs of width ``cols`` shrinks as ``√(cols / rows)``:
    with few rows for a wide layer GPTQ would fit that noise; with many rows the shrinkage vanishes."""
    return diag_damp * math.sqrt(cols / max(rows, 1))


def shrink_to_diagonal(h: torch.Tensor, ratio: float) -> torch.Tensor:
    """``H + ratio · diag(H)``: the Hessian moved towards its diagonal, per channel (scale-equivariant, unlike
    the ``mean(diag H)·I`` damping, which a few loud channels make large for every other one)."""
    if ratio <= 0.0:
        return h
    return h + torch.diag_embed(torch.diagonal(h) * ratio)


def _quantize(x: torch.Tensor, scheme: Scheme, args: Mapping[str, float | bool], calibration: LayerHessian | None,
              name: str) -> QuantizedTensor:
    info = dtype_info(scheme.dtype)
    if calibration is None:
        raise ConfigError("method 'gptq' needs calibration for this tensor", field="calibration", tensor=name)
    act_order = bool(args["act_order"]) and scheme.granularity == "group"
    count = max(calibration.count, 1)
    w, h = x.float(), calibration.hessian.float() / count
    h = shrink_to_diagonal(h, diag_shrink_ratio(float(args["diag_damp"]), cols=w.shape[1], rows=count))
    damp = float(args["damp"])
    channel_scale = None
    if args["awq_scales"]:  # AWQ's per-input-channel scales first: GPTQ then rounds W·s against H / (s sᵀ)
        # searched against the damped H that GPTQ then minimises, not the raw (noisy) one
        damped = h + damp * float(torch.diagonal(h).mean()) * torch.eye(h.shape[0], device=h.device)
        channel_scale = awq_scales(w, damped * count, count, scheme, grid=20, duo_scaling=True, name=name)
        w = w * channel_scale
        h = h / channel_scale.unsqueeze(0) / channel_scale.unsqueeze(1)
    codes, scale, zero, g_idx = gptq(w, h, scheme, info,
                                     damp=damp, block_size=int(args["block_size"]),
                                     act_order=act_order, static_groups=bool(args["static_groups"]), name=name,
                                     clip_grid=int(args["clip_grid"]), max_shrink=float(args["max_shrink"]),
                                     refit_scale=bool(args["refit_scale"]))
    return _result(x, scheme, info, codes, scale, zero, g_idx, method="gptq", channel_scale=channel_scale)


def _result(x: torch.Tensor, scheme: Scheme, info: DTypeInfo, codes: torch.Tensor, scale: torch.Tensor,
            zero: torch.Tensor | None, g_idx: torch.Tensor | None, *, method: str,
            channel_scale: torch.Tensor | None = None) -> QuantizedTensor:
    from quantd.engine.qparams import code_dtype, zero_point_dtype

    sshape = (x.shape[0],) if scheme.granularity == "channel" else tuple(scale.shape)
    return QuantizedTensor(
        codes=codes.to(code_dtype(scheme.dtype)), scale=scale.to(scale_torch_dtype(scheme.scale_dtype)).reshape(sshape),
        zero_point=None if zero is None else zero.to(zero_point_dtype(scheme.dtype)).reshape(sshape),
        shape=tuple(x.shape), dtype=scheme.dtype, orig_dtype=x.dtype, granularity=scheme.granularity, axis=0,
        group_size=scheme.group_size, symmetric=zero is None, method=method, observer=scheme.observer,
        g_idx=g_idx, channel_scale=channel_scale)


def _check(shape: tuple[int, ...], scheme: Scheme, args: Mapping[str, float | bool], name: str) -> None:
    check_linear_weight(shape, scheme, "gptq", name)


def _uses_g_idx(scheme: Scheme, args: Mapping[str, float | bool]) -> bool:
    return bool(args.get("act_order")) and not args.get("static_groups") and scheme.granularity == "group"


GPTQ = register(Method(
    name="gptq", needs="hessian", quantize=_quantize, check=_check, uses_g_idx=_uses_g_idx,
    uses_channel_scale=lambda scheme, args: bool(args.get("awq_scales")),
    description="GPTQ: columns rounded in turn, each error compensated on the later columns through the "
                "inverse Hessian of the layer's inputs (needs calibration; 2-D Linear weights, integer, "
                "per channel or group)",
    args=(
        Arg("damp", "float", 0.1, "damping added to the Hessian's diagonal, relative to its mean", 0.0, 10.0),
        Arg("diag_damp", "float", 0.0, "each H_jj grows by diag_damp·√(in / rows)·H_jj: the Hessian shrunk "
                                       "towards its diagonal when the calibration has few rows (0: off)",
            0.0, 10.0),
        Arg("block_size", "int", 128, "columns per lazy batch update", 1, 65536),
        Arg("act_order", "bool", True, "visit columns by decreasing Hessian diagonal (stores g_idx with groups "
                                       "unless static_groups)"),
        Arg("static_groups", "bool", False, "fix every group's scale and zero point on the original weight "
                                            "before the column loop"),
        Arg("clip_grid", "int", 20, "search each group's range shrink on this grid (0: the observer's range as "
                                    "it is), for the least rounding error weighted by diag H", 0, 200),
        Arg("max_shrink", "float", 0.2, "the most a group's range is shrunk by the search", 0.0, 0.9),
        Arg("refit_scale", "bool", True, "refit each group's scale to the codes by least squares against the "
                                         "damped Hessian after the column loop (rows of at most 256 groups)"),
        Arg("awq_scales", "bool", False, "scale the input channels as AWQ does before GPTQ (stores channel_scale)"),
    )))
