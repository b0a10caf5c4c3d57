"""The method registry and its methods (rtn, hqq, gptq, awq) against small, obviously-correct references."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, get_args

import pytest
import torch

from quantd.engine.methods import METHODS, LayerHessian, check_method, output_rel_error, quantize_tensor
from quantd.engine.methods.hqq import optimize_zero_point
from quantd.engine.primitives import dequantize, quantize
from quantd.engine.stats import bits_per_weight, quantized_error_stats
from quantd.engine.types import QuantizedTensor
from quantd.errors import ConfigError
from quantd_client import Scheme
from quantd_client._schemas import MethodName


def _layer(rows: int = 48, cols: int = 128, n: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight and correlated inputs with a few loud channels (what makes GPTQ and AWQ matter)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    mix = torch.randn(cols, cols, generator=g) / cols**0.5 + torch.eye(cols)
    x = torch.randn(n, cols, generator=g) @ mix
    x[:, :4] *= 8.0
    return w, x


def _rel(w: torch.Tensor, w_hat: torch.Tensor, x: torch.Tensor) -> float:
    """‖X Wᵀ − X Ŵᵀ‖² / ‖X Wᵀ‖², in float64 from the rows themselves."""
    y, y_hat = x.double() @ w.double().T, x.double() @ w_hat.double().T
    return float((y - y_hat).square().sum() / y.square().sum())


def test_registry_is_the_wire_literal() -> None:
    assert list(METHODS) and set(METHODS) == set(get_args(MethodName))
    for m in METHODS.values():
        assert m.needs in ("none", "hessian") and m.description


def test_unknown_and_ill_typed_arguments_are_refused_naming_the_tensor() -> None:
    with pytest.raises(ConfigError, match=r"scheme.method_args.*'w'.*\['nope'\].*hqq"):
        check_method((8, 64), Scheme(method="hqq", method_args={"nope": 1.0}), name="w", has_calibration=False)
    with pytest.raises(ConfigError, match="takes true or false"):
        check_method((8, 64), Scheme(method="gptq", method_args={"act_order": 1.0}), name="w", has_calibration=True)
    with pytest.raises(ConfigError, match="integer"):
        check_method((8, 64), Scheme(method="gptq", method_args={"block_size": 2.5}), name="w", has_calibration=True)
    with pytest.raises(ConfigError, match="no arguments"):
        check_method((8, 64), Scheme(method="rtn", method_args={"x": 1.0}), name="w", has_calibration=False)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_methods_need_calibration_and_linear_weights(method: str) -> None:
    with pytest.raises(ConfigError, match=r"field 'calibration' tensor 'enc.q.weight'.*needs calibration"):
        check_method((8, 64), Scheme(method=method, group_size=32), name="enc.q.weight", has_calibration=False)
    with pytest.raises(ConfigError, match="2-D Linear weights"):
        check_method((8, 4, 16), Scheme(method=method, group_size=32), name="conv", has_calibration=True)
    with pytest.raises(ConfigError, match="integer dtypes"):
        check_method((8, 64), Scheme(method=method, dtype="nf4", group_size=32), name="w", has_calibration=True)


def _gptq_reference(w: torch.Tensor, h: torch.Tensor, scheme: Scheme, damp: float) -> torch.Tensor:
    """Textbook GPTQ/OBQ in float64, one column at a time with the explicit inverse Hessian and its
    rank-one downdate after every column (no Cholesky, no blocks); the groups' parameters from the scheme
    (min-max) on the group's columns when the group is reached. Returns Ŵ."""
    from quantd.engine.qparams import choose_qparams
    from quantd_client._dtypes import dtype_info

    info = dtype_info(scheme.dtype)
    w = w.double().clone()
    h = h.double() + damp * torch.diagonal(h).double().mean() * torch.eye(h.shape[0], dtype=torch.float64)
    hinv = torch.linalg.inv(h)
    out = torch.empty_like(w)
    gs = scheme.group_size
    for j in range(w.shape[1]):
        if j % gs == 0:
            blk = w[:, j:j + gs].float()
            scale, zp = choose_qparams(blk.amin(1), blk.amax(1), dtype=scheme.dtype, symmetric=scheme.symmetric,
                                       scale_dtype=scheme.scale_dtype)
            s, z = scale.double(), zp.double()
        q = (torch.round(w[:, j].float() / s.float()).double() + z).clamp(info.qmin, info.qmax)
        out[:, j] = (q - z) * s
        err = (w[:, j] - out[:, j]) / hinv[j, j]
        w[:, j + 1:] -= err[:, None] * hinv[j, j + 1:][None, :]
        hinv = hinv - hinv[:, j:j + 1] @ hinv[j:j + 1, :] / hinv[j, j]
    return out


def test_gptq_matches_a_per_column_reference_on_a_tiny_layer() -> None:
    w, x = _layer(rows=24, cols=64, n=256)
    h = x.T @ x
    scheme = Scheme(dtype="int4", group_size=16, method="gptq",
                    method_args={"block_size": 32, "act_order": False, "clip_grid": 0, "damp": 0.01,
                                 "refit_scale": False})
    qt = quantize_tensor(w, scheme, name="w", calibration=LayerHessian(h, x.shape[0]))
    ours = dequantize(qt)
    ref = _gptq_reference(w, h / x.shape[0], scheme, damp=0.01)
    same = (ours.double() - ref).abs() <= 1e-4 * ref.abs().max()
    assert same.float().mean() > 0.97  # float32 vs float64 may round a rare column the other way
    assert _rel(w, ours, x) == pytest.approx(_rel(w, ref.float(), x), rel=0.1)
    assert _rel(w, ours, x) < 0.8 * _rel(w, dequantize(quantize(w, scheme.model_copy(update={"method": "rtn"}))), x)


@pytest.mark.parametrize("static_groups", [False, True])
def test_gptq_act_order_result_dequantizes_through_g_idx(static_groups: bool) -> None:
    w, x = _layer()
    scheme = Scheme(dtype="int4", group_size=32, method="gptq",
                    method_args={"act_order": True, "static_groups": static_groups})
    qt = quantize_tensor(w, scheme, name="w", calibration=LayerHessian(x.T @ x, x.shape[0]))
    assert (qt.g_idx is None) == static_groups
    g_idx = qt.g_idx.long() if qt.g_idx is not None else torch.arange(w.shape[1]) // 32
    if qt.g_idx is not None:  # every group holds group_size columns, in decreasing Hessian order
        assert torch.bincount(g_idx).tolist() == [32] * 4
        assert not torch.equal(g_idx, torch.arange(w.shape[1]) // 32)
    assert qt.zero_point is not None and qt.scale is not None
    manual = (qt.codes.float() - qt.zero_point.float()[:, g_idx]) * qt.scale.float()[:, g_idx]
    torch.testing.assert_close(dequantize(qt), manual, rtol=0, atol=0)
    rtn = dequantize(quantize(w, scheme.model_copy(update={"method": "rtn"})))
    assert _rel(w, dequantize(qt), x) < _rel(w, rtn, x)
    stats = quantized_error_stats(w, qt)
    assert stats.numel == w.numel() and stats.bits_per_weight == bits_per_weight(qt)


def test_gptq_defaults_to_act_order_with_groups() -> None:
    """``method: gptq`` with no arguments visits columns in act-order (g_idx with groups); ``act_order: false``
    keeps the column order and contiguous groups."""
    w, x = _layer()
    cal = LayerHessian(x.T @ x, x.shape[0])
    default = quantize_tensor(w, Scheme(dtype="int4", group_size=32, method="gptq"), name="w", calibration=cal)
    explicit = quantize_tensor(w, Scheme(dtype="int4", group_size=32, method="gptq",
                                         method_args={"act_order": True}), name="w", calibration=cal)
    plain = quantize_tensor(w, Scheme(dtype="int4", group_size=32, method="gptq",
                                      method_args={"act_order": False}), name="w", calibration=cal)
    assert default.g_idx is not None and explicit.g_idx is not None and plain.g_idx is None
    assert torch.equal(default.codes, explicit.codes) and torch.equal(default.g_idx, explicit.g_idx)
    assert not torch.equal(default.codes, plain.codes)


def test_gptq_per_channel_and_dead_inputs() -> None:
    w, x = _layer(rows=16, cols=64)
    x[:, 5] = 0.0  # an input that never fires: its weights are dropped, as in the reference implementations
    qt = quantize_tensor(w, Scheme(dtype="int8", granularity="channel", symmetric=True, method="gptq"), name="w",
                         calibration=LayerHessian(x.T @ x, x.shape[0]))
    assert qt.scale is not None and qt.scale.shape == (16,) and qt.g_idx is None
    assert torch.all(dequantize(qt)[:, 5] == 0)


def test_output_rel_error_is_the_layer_output_error() -> None:
    w, x = _layer()
    qt = quantize(w, Scheme(dtype="int3", group_size=32))
    assert output_rel_error(w, qt, x.T @ x) == pytest.approx(_rel(w, dequantize(qt), x), rel=1e-4)
    assert output_rel_error(w, qt, torch.eye(64)) is None  # another width: not this layer's inputs


def _hqq_objective(w: torch.Tensor, qt: QuantizedTensor, p: float = 0.7) -> torch.Tensor:
    return (w - dequantize(qt)).abs().reshape(-1, qt.group_size).pow(p).mean(dim=1)


@pytest.mark.parametrize("dtype", ["int2", "int3", "int4", "uint8"])
def test_hqq_improves_on_its_fitted_start_and_stores_float_zero_points(dtype: str) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 256, generator=g) * torch.rand(32, 1, generator=g) * 0.05
    w[0, :3] = 0.3  # outliers: what the non-convex norm lets go
    scheme = Scheme(dtype=dtype, group_size=64, method="hqq")
    qt = quantize_tensor(w, scheme, name="w")
    start = quantize_tensor(w, scheme.model_copy(update={"method_args": {"iters": 1}}), name="w")
    assert qt.zero_point_domain == "float" and qt.zero_point is not None
    assert qt.zero_point.dtype == torch.float16 and not torch.equal(qt.zero_point, qt.zero_point.round())
    l1 = (w - dequantize(qt)).abs().reshape(-1, 64).mean(1)
    l1_start = (w - dequantize(start)).abs().reshape(-1, 64).mean(1)
    assert torch.all(l1 <= l1_start * (1 + 1e-5))  # each block keeps its best stored zero point
    assert float(l1.mean()) < float(l1_start.mean())
    assert float(_hqq_objective(w, qt).mean()) < float(_hqq_objective(w, start).mean())
    rtn = quantize(w, scheme.model_copy(update={"method": "rtn"}))
    assert float((w - dequantize(qt)).abs().mean()) < float((w - dequantize(rtn)).abs().mean())
    codes = qt.codes.float()
    assert codes.min() >= -(2 ** (int(dtype[-1]) - 1)) if dtype.startswith("int") else codes.min() >= 0


def test_hqq_zero_point_update_is_the_half_quadratic_step() -> None:
    """One iteration by hand: W_q, W_r, the generalised soft threshold, then z = mean(W_q − (W − W_e)/s)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(4, 16, generator=g)
    s = ((w.amax(1, keepdim=True) - w.amin(1, keepdim=True)) / 15).float()
    z0 = -w.amin(1, keepdim=True) / s
    wq = torch.round(w / s + z0).clamp(0, 15)
    e = w - (wq - z0) * s
    we = torch.sign(e) * torch.relu(e.abs() - e.abs().pow(-0.3) / 10.0)
    z1 = (wq - (w - we) / s).mean(1, keepdim=True)
    err = lambda z: (w - (torch.round(w / s + z).clamp(0, 15) - z) * s).abs().mean(1, keepdim=True)  # noqa: E731
    got = optimize_zero_point(w, s, z0, levels=15, iters=2, lp_norm=0.7, beta=10.0, kappa=1.01)
    torch.testing.assert_close(got, torch.where(err(z1) < err(z0), z1, z0))


def test_hqq_start_search_and_refits_lower_the_squared_error() -> None:
    """The least-squares range search beats the min-max range (ratio 1 alone, no refit), and each refit keeps
    or lowers every block's squared error."""
    from quantd.engine.methods.hqq import _start, shrink_ratios

    g = torch.Generator().manual_seed(4)
    w = torch.randn(512, 64, generator=g) * torch.rand(512, 1, generator=g)
    lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    y = (w - (lo + hi) / 2) / (hi - lo)

    def sq_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ((torch.round((y - b) / a).clamp(0, 15) * a + b) - y).square().sum(1)

    minmax = sq_err(*_start(y, (1.0,), 0, 15.0))
    searched = [sq_err(*_start(y, shrink_ratios(0.15, 3), refits, 15.0)) for refits in range(3)]
    assert float(searched[0].sum()) < 0.95 * float(minmax.sum())
    for before, after in itertools.pairwise(searched):
        assert bool((after <= before * (1 + 1e-5)).all()) and float(after.sum()) < float(before.sum())
    scheme = Scheme(dtype="int4", group_size=64, method="hqq")
    x = w.reshape(64, 512)
    new = quantize_tensor(x, scheme, name="w")
    ref = quantize_tensor(x, scheme.model_copy(update={"method_args": {"max_shrink": 0.0, "refits": 0}}), name="w")
    assert float((dequantize(new) - x).square().sum()) < float((dequantize(ref) - x).square().sum())


def test_hqq_search_along_either_dimension_agrees() -> None:
    """The search on the blocks' transposed view (what the compiled kernel computes on: blocks along dim 0)
    gives each block the scale and zero point it gets along dim 1, but for last-bit differences in the sums."""
    from quantd.engine.methods.hqq import _betas, _search, shrink_ratios

    g = torch.Generator().manual_seed(8)
    w = torch.randn(300, 64, generator=g) * torch.rand(300, 1, generator=g)
    kw = {"levels": 15.0, "ratios": shrink_ratios(0.15, 3), "refits": 2, "betas": _betas(1000.0, 1.01, 2),
          "p": 0.7, "scale_dtype": torch.float16, "qmin": 0.0}
    rows = _search(w, w.amin(1, keepdim=True), w.amax(1, keepdim=True), **kw)
    wt = w.t()
    cols = _search(wt, wt.amin(0, keepdim=True), wt.amax(0, keepdim=True), dim=0, **kw)
    assert cols[0].shape == (1, 300) and cols[1].shape == (1, 300) and cols[2].shape == (64, 300)
    assert float((cols[0].t() != rows[0]).float().mean()) < 0.02
    assert torch.allclose(cols[1].t(), rows[1], rtol=1e-3, atol=1e-3)
    same = (cols[0].t() == rows[0]).squeeze(1)
    assert torch.equal(cols[2].t()[same], rows[2][same])  # v = w / scale


def _heavy_tailed(rows: int, cols: int, seed: int, df: int = 3) -> torch.Tensor:
    """Student-t weights (``df`` degrees of freedom, scale 0.02): a few large values in every block."""
    g = torch.Generator().manual_seed(seed)
    n = torch.randn(rows, cols, generator=g)
    chi2 = torch.randn(df, rows, cols, generator=g).square().sum(0)
    return 0.02 * n / (chi2 / df).sqrt()


def _reference_hqq(w: torch.Tensor, bits: int, group_size: int, iters: int = 20) -> torch.Tensor:
    """``x̂`` of hqq's ``Quantizer`` (``optimize_weights_proximal_legacy``, its default parameters): min-max
    start, the half-quadratic steps until the mean error stops falling; float16 scale and zero point."""
    levels, beta = 2**bits - 1, 10.0
    x = w.reshape(-1, group_size)
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    inv = (levels / (hi - lo)).clamp(max=2e4)
    zero, best = -lo * inv, float("inf")
    for _ in range(iters):
        wq = torch.round(x * inv + zero).clamp(0, levels)
        wr = (wq - zero) / inv
        e = x - wr
        we = torch.sign(e) * torch.relu(e.abs() - e.abs().pow(-0.3) / beta)
        zero, beta = (wq - (x - we) * inv).mean(1, keepdim=True), beta * 1.01
        err = float((x - wr).abs().mean())
        if err >= best:
            break
        best = err
    s, z = (1 / inv).half().float(), zero.half().float()
    return ((torch.round(x / s + z).clamp(0, levels) - z) * s).reshape(w.shape)


@pytest.mark.parametrize("dtype", ["int2", "int3", "int4"])
def test_hqq_beats_rtn_and_the_reference_on_heavy_tailed_weights(dtype: str) -> None:
    """On Student-t weights, squared, absolute and p = 0.7 errors all below RTN min-max's and below those of
    the reference's iteration, each by at least 2 %."""
    w = _heavy_tailed(256, 512, seed=0)
    scheme = Scheme(dtype=dtype, group_size=64, method="hqq")
    ours = dequantize(quantize_tensor(w, scheme, name="w"))
    rtn = dequantize(quantize(w, scheme.model_copy(update={"method": "rtn"})))
    ref = _reference_hqq(w, int(dtype[-1]), 64)

    def errors(x: torch.Tensor) -> torch.Tensor:
        e = (x - w).abs()
        return torch.stack([e.square().mean(), e.mean(), e.pow(0.7).mean()])

    assert bool((errors(ours) < 0.98 * errors(rtn)).all())
    assert bool((errors(ours) < 0.98 * errors(ref)).all())


@pytest.mark.parametrize("c", [-1.9, -1.3, -1.0])
def test_hqq_step_weight_power(c: float) -> None:
    """The step's weights ``min(top, a^c)`` from the bit pattern: within 10 % of the power over many decades,
    ``top`` where the power exceeds it (``a = 0`` included), and 0 at infinity, never NaN or negative."""
    from quantd.engine.methods.hqq import _power_at_most

    a = torch.logspace(-6, 4, 100_001)
    got = _power_at_most(a.clone(), c, 1e30)
    ratio = got / a.pow(c)
    assert float(ratio.min()) > 0.9 and float(ratio.max()) < 1.1
    edge = _power_at_most(torch.tensor([0.0, 1e-45, 1e-30, 1.0, float("inf")]), c, 1000.0)
    assert edge[:3].tolist() == [1000.0] * 3
    assert edge[3].item() == pytest.approx(1.0, rel=0.1) and edge[4].item() == 0.0


@pytest.mark.parametrize("dtype", ["int4", "uint8", "int3"])
def test_hqq_compiled_equals_eager(compiled: None, dtype: str) -> None:
    """The compiled search and codes compute what the eager ops compute."""
    from quantd.engine import kernels

    g = torch.Generator().manual_seed(6)
    w = torch.randn(96, 256, generator=g) * torch.rand(96, 1, generator=g) * 0.05
    scheme = Scheme(dtype=dtype, group_size=64, method="hqq")
    got = quantize_tensor(w, scheme, name="w")
    kernels.KERNELS.reset(available=False)
    want = quantize_tensor(w, scheme, name="w")
    kernels.KERNELS.reset(available=True)
    assert got.scale is not None and want.scale is not None and got.zero_point is not None
    assert want.zero_point is not None
    # the sums' and the step's vectorised forms (fused multiply-adds) may differ in the last bits, which a
    # rounding can carry on: some parameters differ, mostly by one float16 step, and the error they reach
    # hardly does
    assert float((got.scale != want.scale).float().mean()) < 0.02
    gz, wz = got.zero_point.float(), want.zero_point.float()
    assert float(((gz - wz).abs() > wz.abs() * 2.0**-10 + 2.0**-14).float().mean()) < 0.05
    err = [float((dequantize(qt) - w).abs().mean()) for qt in (got, want)]
    assert err[0] == pytest.approx(err[1], rel=1e-2)
    same = ((got.zero_point == want.zero_point) & (got.scale == want.scale)).reshape(-1)
    a, b = got.codes.reshape(-1, 64)[same], want.codes.reshape(-1, 64)[same]  # the same parameters: the same
    assert float((a != b).float().mean()) < 1e-3  # codes, but for a rare tie at .5


def test_hqq_long_settings_run_eager(compiled: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled kernel unrolls every candidate and step: a setting with hundreds of them runs eager rather
    than holding the compiler for minutes; the defaults take the kernel."""
    from quantd.engine import kernels

    names: list[str] = []
    real = kernels.KERNELS.call

    def spy(name: str, *args: Any, **kwargs: Any) -> Any:
        names.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(kernels.KERNELS, "call", spy)
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(6))
    long = Scheme(dtype="int4", group_size=64, method="hqq", method_args={"iters": 1000})
    qt = quantize_tensor(w, long, name="w")
    assert not any(n.startswith("hqq") for n in names)
    assert float((dequantize(qt) - w).abs().mean()) < float(w.abs().mean()) / 4
    quantize_tensor(w, Scheme(dtype="int4", group_size=64, method="hqq"), name="w")
    assert any(n.startswith("hqq_fused") for n in names)


@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_hqq_chunking_does_not_change_the_result(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
                                                 path: str) -> None:
    """Blocks are independent: chunks of 7 block rows give the one-chunk result, eager and compiled."""
    from quantd.engine.methods import hqq

    request.getfixturevalue(path)
    g = torch.Generator().manual_seed(6)
    w = torch.randn(96, 256, generator=g) * torch.rand(96, 1, generator=g)
    scheme = Scheme(dtype="int4", group_size=64, method="hqq")
    whole = quantize_tensor(w, scheme, name="w")
    monkeypatch.setattr(hqq, "_CHUNK_ELEMENTS", 7 * 64)
    monkeypatch.setattr(hqq, "_COMPILED_CHUNK_ELEMENTS", 7 * 64)
    chunked = quantize_tensor(w, scheme, name="w")
    assert whole.scale is not None and chunked.scale is not None
    assert whole.zero_point is not None and chunked.zero_point is not None
    assert torch.equal(whole.codes, chunked.codes) and torch.equal(whole.scale, chunked.scale)
    assert torch.equal(whole.zero_point, chunked.zero_point)


def test_awq_beats_rtn_on_loud_channels_and_stores_channel_scale() -> None:
    w, x = _layer(rows=64, cols=128, n=1024)
    scheme = Scheme(dtype="int4", group_size=64, method="awq")
    qt = quantize_tensor(w, scheme, name="w", calibration=LayerHessian(x.T @ x, x.shape[0]))
    assert qt.channel_scale is not None and qt.channel_scale.shape == (128,) and qt.channel_scale.dtype == torch.float32
    assert qt.scale is not None and qt.zero_point is not None
    idx = torch.arange(128) // 64
    manual = (qt.codes.float() - qt.zero_point.float()[:, idx]) * qt.scale.float()[:, idx] / qt.channel_scale
    torch.testing.assert_close(dequantize(qt), manual)
    rtn = dequantize(quantize(w, scheme.model_copy(update={"method": "rtn"})))
    assert _rel(w, dequantize(qt), x) < 0.95 * _rel(w, rtn, x)
    stats = quantized_error_stats(w, qt)
    assert 0.0 <= stats.clipped_fraction <= 1.0 and stats.theoretical_max_error is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("method", ["hqq", "gptq", "awq"])
def test_methods_run_on_cuda(method: str) -> None:
    w, x = _layer()
    scheme = Scheme(dtype="int4", group_size=32, method=method)
    cal = LayerHessian((x.T @ x).cuda(), x.shape[0])
    qt_gpu = quantize_tensor(w.cuda(), scheme, name="w", calibration=cal)
    assert qt_gpu.codes.is_cuda
    rtn = dequantize(quantize(w, scheme.model_copy(update={"method": "rtn"})))
    assert _rel(w, dequantize(qt_gpu).cpu(), x) < _rel(w, rtn, x)


def test_gptq_with_awq_scales_and_clip_search() -> None:
    w, x = _layer(rows=32, cols=128, n=1024)
    h = LayerHessian(x.T @ x, x.shape[0])
    plain = quantize_tensor(w, Scheme(dtype="int4", group_size=32, method="gptq",
                                      method_args={"clip_grid": 0, "act_order": False}), name="w", calibration=h)
    scaled = quantize_tensor(w, Scheme(dtype="int4", group_size=32, method="gptq",
                                       method_args={"awq_scales": True, "act_order": False}), name="w", calibration=h)
    assert plain.channel_scale is None and scaled.channel_scale is not None
    assert scaled.scale is not None and scaled.zero_point is not None
    idx = torch.arange(128) // 32
    manual = ((scaled.codes.float() - scaled.zero_point.float()[:, idx]) * scaled.scale.float()[:, idx]
              / scaled.channel_scale)
    torch.testing.assert_close(dequantize(scaled), manual)
    assert _rel(w, dequantize(scaled), x) < _rel(w, dequantize(plain), x)


def _awq_scales_loop(w: torch.Tensor, h: torch.Tensor, count: int, scheme: Scheme, grid: int) -> torch.Tensor:
    """AWQ's scale search written plainly: one ``α`` at a time, ``tr(ΔW H ΔWᵀ)`` from ``H`` itself."""
    gs = scheme.group_size if scheme.granularity == "group" else w.shape[1]
    x_rms = (torch.diagonal(h).clamp_min(0) / count).sqrt()
    wn = w.abs().reshape(w.shape[0], -1, gs)
    w_mean = (wn / wn.amax(dim=2, keepdim=True).clamp_min(1e-12)).reshape(w.shape).mean(dim=0)
    rtn = scheme.model_copy(update={"method": "rtn"})
    best, best_err = torch.ones_like(x_rms), float("inf")
    for k in range(grid):
        alpha = k / grid
        s = (x_rms.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp_min(1e-4)
        s = s / (s.max() * s.min()).sqrt()
        dw = dequantize(quantize(w * s, rtn)) / s - w
        err = float(((dw.double() @ h.double()) * dw.double()).sum())
        if err < best_err:
            best, best_err = s, err
    return best


@pytest.mark.parametrize(("rows", "cols", "granularity", "symmetric", "dead", "stack"), [
    (48, 128, "group", False, False, 1 << 24), (96, 256, "group", True, False, 1 << 24),
    (64, 192, "channel", False, False, 1 << 24), (32, 128, "group", False, True, 1 << 24),
    (40, 128, "group", False, False, 3 * 40 * 128)])
def test_awq_scale_search_picks_what_the_per_candidate_loop_picks(
        rows: int, cols: int, granularity: str, symmetric: bool, dead: bool, stack: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The stacked search (Cholesky-factored error, candidates in stacks) against the plain loop, on random
    layers: positive definite H, H with a dead input (no Cholesky factor), and stacks smaller than the grid."""
    from quantd.engine.methods import awq

    monkeypatch.setattr(awq, "STACK_ELEMENTS", stack)
    scheme = Scheme(dtype="int4", granularity=granularity, group_size=64, symmetric=symmetric, method="awq")
    for seed in range(3):
        w, x = _layer(rows=rows, cols=cols, n=2048, seed=seed)
        if dead:
            x[:, 7] = 0.0
        h = x.T @ x
        got = awq.awq_scales(w, h, x.shape[0], scheme, grid=20, duo_scaling=True, name="w")
        torch.testing.assert_close(got, _awq_scales_loop(w, h, x.shape[0], scheme, 20), rtol=1e-5, atol=0.0)


def _awq_clip_loop(ws: torch.Tensor, s: torch.Tensor, h: torch.Tensor, scheme: Scheme, grid: int,
                   max_shrink: float) -> torch.Tensor:
    """AWQ's clipping search written plainly: one ratio at a time, each block's error through its block of H."""
    gs = scheme.group_size
    g = ws.shape[1] // gs
    hs = h / s.unsqueeze(0) / s.unsqueeze(1)
    rtn = scheme.model_copy(update={"method": "rtn"})
    best = torch.ones(ws.shape[0], g)
    best_err = torch.full((ws.shape[0], g), float("inf"))
    for k in range(int(max_shrink * grid)):
        r = 1.0 - k / grid
        lo, hi = ws.reshape(-1, gs).amin(dim=1), ws.reshape(-1, gs).amax(dim=1)
        d = (dequantize(quantize(ws, rtn, observer_range=(lo * r, hi * r))) - ws).reshape(ws.shape[0], g, gs)
        err = torch.stack([torch.einsum("ri,ij,rj->r", d[:, j], hs[j * gs:(j + 1) * gs, j * gs:(j + 1) * gs],
                                        d[:, j]) for j in range(g)], dim=1)
        best = torch.where(err < best_err, r, best)
        best_err = torch.minimum(err, best_err)
    return best.reshape(-1)


@pytest.mark.parametrize("stack", [1 << 24, 3 * 40 * 128])
def test_awq_clip_search_picks_what_the_per_ratio_loop_picks(stack: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from quantd.engine.methods import awq

    monkeypatch.setattr(awq, "STACK_ELEMENTS", stack)
    scheme = Scheme(dtype="int4", group_size=32, method="awq")
    for seed in range(3):
        w, x = _layer(rows=40, cols=128, n=2048, seed=seed)
        h = x.T @ x
        s = awq.awq_scales(w, h, x.shape[0], scheme, grid=20, duo_scaling=True, name="w")
        got = awq.awq_clip(w * s, s, h, scheme, grid=20, max_shrink=0.5, name="w")
        want = _awq_clip_loop(w * s, s, h, scheme, 20, 0.5)
        assert bool((want < 1.0).any())  # the search moves some blocks
        assert float((got != want).float().mean()) < 0.01  # a rare block within rounding of a tie


def _loud_inputs(cols: int, seed: int, correlation: float) -> tuple[torch.Tensor, Callable[[int], torch.Tensor]]:
    """A weight ``[64, cols]`` and a sampler of inputs with log-normal channel scales and a few loud channels."""
    g = torch.Generator().manual_seed(seed)
    mix = correlation * torch.randn(cols, cols, generator=g) / cols**0.5 + torch.eye(cols)
    loud = torch.exp(0.8 * torch.randn(cols, generator=g))
    loud[:4] *= 20.0
    return torch.randn(64, cols, generator=g), lambda n: (torch.randn(n, cols, generator=g) @ mix) * loud


def test_gptq_diag_damp_generalises_from_few_calibration_rows() -> None:
    """With as many calibration rows as input features, GPTQ on the raw Hessian fits the rows' noise: on
    held-out inputs of the same distribution the shrunk Hessian (diag_damp) does better, and both beat RTN;
    with 16 rows a feature the shrinkage is small and costs little."""
    w, inputs = _loud_inputs(256, seed=0, correlation=0.3)
    x, held_out = inputs(256), inputs(2048)
    cal = LayerHessian(x.T @ x, x.shape[0])
    scheme = Scheme(dtype="int4", group_size=64, method="gptq", method_args={"damp": 0.01, "diag_damp": 0.2})
    raw_scheme = scheme.model_copy(update={"method_args": {"damp": 0.01}})
    default = dequantize(quantize_tensor(w, scheme, name="w", calibration=cal))
    raw = dequantize(quantize_tensor(w, raw_scheme, name="w", calibration=cal))
    rtn = dequantize(quantize(w, scheme.model_copy(update={"method": "rtn"})))
    assert _rel(w, raw, x) < _rel(w, default, x)  # the raw Hessian fits the calibration rows better...
    assert _rel(w, default, held_out) < 0.85 * _rel(w, raw, held_out)  # ...and other inputs worse
    assert _rel(w, default, held_out) < 0.85 * _rel(w, rtn, held_out)
    x = inputs(16 * 256)
    cal = LayerHessian(x.T @ x, x.shape[0])
    default = dequantize(quantize_tensor(w, scheme, name="w", calibration=cal))
    raw = dequantize(quantize_tensor(w, raw_scheme, name="w", calibration=cal))
    assert _rel(w, default, held_out) < 1.05 * _rel(w, raw, held_out)


def test_gptq_defaults_beat_the_papers_on_held_out_inputs() -> None:
    """The defaults (damping 0.1, act-order, the diag-H-weighted range search, the scale refit) against the
    paper's GPTQ (damping 0.01, column order, the observer's range) on inputs other than the calibration rows."""
    w, inputs = _loud_inputs(256, seed=1, correlation=0.3)
    x, held_out = inputs(512), inputs(2048)
    cal = LayerHessian(x.T @ x, x.shape[0])
    scheme = Scheme(dtype="int4", group_size=64, method="gptq")
    default = dequantize(quantize_tensor(w, scheme, name="w", calibration=cal))
    paper = dequantize(quantize_tensor(w, scheme.model_copy(update={"method_args": {
        "damp": 0.01, "act_order": False, "clip_grid": 0, "refit_scale": False}}), name="w", calibration=cal))
    assert _rel(w, default, held_out) < 0.85 * _rel(w, paper, held_out)


def test_gptq_diag_shrinkage_follows_width_over_rows() -> None:
    from quantd.engine.methods.gptq import diag_shrink_ratio, shrink_to_diagonal

    assert diag_shrink_ratio(0.2, cols=1024, rows=1024) == pytest.approx(0.2)
    assert diag_shrink_ratio(0.2, cols=1024, rows=16 * 1024) == pytest.approx(0.05)
    h = torch.tensor([[4.0, 1.0], [1.0, 9.0]])
    torch.testing.assert_close(shrink_to_diagonal(h, 0.5), torch.tensor([[6.0, 1.0], [1.0, 13.5]]))
    assert shrink_to_diagonal(h, 0.0) is h


@pytest.mark.parametrize("static_groups", [False, True])
def test_gptq_clip_search_never_loses_to_the_observer_range(static_groups: bool) -> None:
    """The searched range includes the observer's own (ratio 1), so each group's diag-H-weighted rounding
    error of the original weight is no larger with the search (static groups: exactly that criterion)."""
    w, x = _layer(rows=32, cols=128, n=1024)
    h = x.T @ x
    args = {"static_groups": static_groups, "act_order": False, "refit_scale": False}
    qts = [quantize_tensor(w, Scheme(dtype="int4", group_size=32, method="gptq",
                                     method_args={**args, "clip_grid": grid}), name="w",
                           calibration=LayerHessian(h, x.shape[0])) for grid in (0, 20)]
    if static_groups:  # the codes are GPTQ's, the ranges those of the weight: compare the ranges' rounding
        errs = []
        for qt in qts:
            assert qt.scale is not None and qt.zero_point is not None
            s = qt.scale.float().repeat_interleave(32, dim=1)
            z = qt.zero_point.float().repeat_interleave(32, dim=1)
            d = ((torch.round(w / s) + z).clamp(-8, 7) - z) * s - w
            errs.append(((d * d) * torch.diagonal(h)).reshape(32, 4, 32).sum(dim=2))
        assert bool((errs[1] <= errs[0] * (1 + 1e-5)).all()) and float(errs[1].sum()) < float(errs[0].sum())
        assert not torch.equal(qts[0].scale, qts[1].scale)
    assert _rel(w, dequantize(qts[1]), x) < _rel(w, dequantize(qts[0]), x)


def _damped_objective(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor, damp: float) -> torch.Tensor:
    """Each row's ``(w − ŵ) H_damped (w − ŵ)ᵀ`` in float64: what GPTQ minimises."""
    hd = h.double() + damp * torch.diagonal(h).double().mean() * torch.eye(h.shape[0], dtype=torch.float64)
    d = (w - w_hat).double()
    return ((d @ hd) * d).sum(dim=1)


@pytest.mark.parametrize(("granularity", "args"), [
    ("group", {"act_order": False}), ("group", {}), ("group", {"static_groups": True}), ("channel", {})])
@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_scale_refit_is_the_least_squares_scale_for_its_codes(
        granularity: str, args: dict[str, Any], symmetric: bool) -> None:
    """The refit keeps GPTQ's codes and zero points and moves each row's group scales to the solution of the
    damped-Hessian least squares for those codes (checked row by row against ``lstsq`` in float64 on
    ``H^½``), so no row's objective grows."""
    w, x = _layer(rows=24, cols=128, n=1024)
    h, n = x.T @ x, x.shape[0]
    scheme = Scheme(dtype="int4", granularity=granularity, group_size=32, symmetric=symmetric, method="gptq",
                    method_args=args)
    cal = LayerHessian(h, n)
    on = quantize_tensor(w, scheme, name="w", calibration=cal)
    off = quantize_tensor(w, scheme.model_copy(update={"method_args": {**args, "refit_scale": False}}), name="w",
                          calibration=cal)
    assert torch.equal(on.codes, off.codes) and (on.g_idx is None) == (off.g_idx is None)
    assert on.zero_point is None if symmetric else torch.equal(on.zero_point, off.zero_point)
    assert on.scale is not None and off.scale is not None and not torch.equal(on.scale, off.scale)
    before, after = (_damped_objective(w, dequantize(qt), h / n, 0.1) for qt in (off, on))
    assert bool((after <= before * (1 + 1e-6)).all()) and float(after.sum()) < 0.99 * float(before.sum())
    # the least-squares scales, row by row: ŵ = A a with A[j, g] = (code_j − z_j) for j in group g
    gs = 32 if granularity == "group" else 128
    g_idx = on.g_idx.long() if on.g_idx is not None else torch.arange(128) // gs
    zero = 0.0 if on.zero_point is None else on.zero_point.double().reshape(24, -1)[:, g_idx]
    q = on.codes.double() - zero
    hd = (h / n).double() + 0.1 * torch.diagonal(h / n).double().mean() * torch.eye(128, dtype=torch.float64)
    root = torch.linalg.cholesky(hd).T  # hd = rootᵀ root
    onehot = torch.nn.functional.one_hot(g_idx).double()
    for r in range(24):
        a = torch.linalg.lstsq(root @ (q[r, :, None] * onehot), root @ w[r].double()).solution
        torch.testing.assert_close(on.scale.double().reshape(24, -1)[r], a, rtol=2e-3, atol=0)


def test_gptq_scale_refit_lowers_the_held_out_error() -> None:
    """On inputs other than the calibration rows the refitted scales still do better (act-order, groups)."""
    w, inputs = _loud_inputs(256, seed=2, correlation=0.3)
    x, held_out = inputs(1024), inputs(4096)
    cal = LayerHessian(x.T @ x, x.shape[0])
    for symmetric in (True, False):
        scheme = Scheme(dtype="int4", group_size=64, symmetric=symmetric, method="gptq")
        on = dequantize(quantize_tensor(w, scheme, name="w", calibration=cal))
        off = dequantize(quantize_tensor(w, scheme.model_copy(update={"method_args": {"refit_scale": False}}),
                                         name="w", calibration=cal))
        assert _rel(w, on, held_out) < _rel(w, off, held_out)


def test_the_docs_tables_list_every_method_and_argument() -> None:
    """docs/methods.md's tables name every registered method and each argument with its default."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "methods.md").read_text(encoding="utf-8")
    for m in METHODS.values():
        assert f"| `{m.name}`" in text, m.name
        for a in m.args:
            row = next((ln for ln in text.splitlines()
                        if ln.startswith(f"| `{m.name}` |") and f"`{a.name}`" in ln.split("|")[2]), None)
            assert row is not None, (m.name, a.name)
            default = str(a.default).lower() if isinstance(a.default, bool) else f"{a.default:g}"
            assert default in row, (m.name, a.name, default, row)


def test_gptq_scale_refit_is_skipped_for_rows_of_many_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row's [G, G] systems grow with the square of its groups: past REFIT_MAX_GROUPS the refit is left out
    (GPTQ's own scales), below it the same layer is refitted."""
    from quantd.engine.methods import gptq as gptq_module

    w, x = _layer(rows=16, cols=128, n=512)
    cal = LayerHessian(x.T @ x, x.shape[0])
    scheme = Scheme(dtype="int4", group_size=32, method="gptq")
    off = quantize_tensor(w, scheme.model_copy(update={"method_args": {"refit_scale": False}}), name="w",
                          calibration=cal)
    assert not torch.equal(quantize_tensor(w, scheme, name="w", calibration=cal).scale, off.scale)
    monkeypatch.setattr(gptq_module, "REFIT_MAX_GROUPS", 3)  # 4 groups a row
    assert torch.equal(quantize_tensor(w, scheme, name="w", calibration=cal).scale, off.scale)
