from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from quantd.engine import observers as obs
from quantd.engine.observers import ActivationObserver, mse_chunk_plan, observe_range, percentile_range
from quantd.engine.primitives import dequantize, quantize
from quantd.engine.qparams import choose_qparams, divisor_tensor
from quantd.errors import ConfigError, NonFiniteError
from quantd_client import Scheme


def _compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled as the engine compiles its kernels (for the parts of a kernel tested alone)."""
    from quantd.engine import kernels

    compiler = kernels._Compiled()
    compiler.reset(available=True)

    def run(*args: Any) -> Any:
        out = compiler.call(fn.__name__, fn, tuple(a for a in args if not isinstance(a, torch.Tensor)), *args)
        assert out is not None and compiler._broken is None, compiler._broken
        return out

    return run


def _heavy(rows: int = 16, cols: int = 512, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x[:, :3] *= 30.0  # a few large outliers per row
    return x


def _mse(x: torch.Tensor, scheme: Scheme, rng: tuple[torch.Tensor, torch.Tensor] | None = None) -> float:
    qt = quantize(x, scheme, observer_range=rng)
    return float((dequantize(qt) - x).pow(2).mean())


@pytest.mark.parametrize("k", [1, 2, 7, 128, 1000])
@pytest.mark.parametrize("p", [100.0, 99.99, 99.0, 90.0, 50.0, 3.0])
def test_percentile_matches_torch_quantile(k: int, p: float) -> None:
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(k))
    lo, hi = percentile_range(x, p, symmetric=False)
    torch.testing.assert_close(hi, torch.quantile(x, p / 100, dim=1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lo, torch.quantile(x, 1 - p / 100, dim=1), atol=1e-5, rtol=1e-5)
    lo_s, hi_s = percentile_range(x, p, symmetric=True)
    torch.testing.assert_close(hi_s, torch.quantile(x.abs(), p / 100, dim=1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lo_s, -hi_s)


@pytest.mark.parametrize("observer", ["minmax", "percentile", "meanstd", "ema", "mse", "entropy"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_per_channel_matches_per_row_reference(observer: str, symmetric: bool) -> None:
    x = _heavy(rows=6, cols=256)
    scheme = Scheme(dtype="int8", symmetric=symmetric, granularity="channel", observer=observer)
    lo, hi = observe_range(x, scheme)
    assert lo.shape == hi.shape == (6,) and lo.dtype == torch.float32
    for i in range(6):
        lo_i, hi_i = observe_range(x[i:i + 1], scheme)
        torch.testing.assert_close(lo[i:i + 1], lo_i)
        torch.testing.assert_close(hi[i:i + 1], hi_i)


def test_minmax_and_meanstd_reference() -> None:
    x = _heavy(rows=4, cols=300)
    lo, hi = observe_range(x, Scheme(dtype="int8", observer="minmax"))
    torch.testing.assert_close(lo, x.min(1).values)
    torch.testing.assert_close(hi, x.max(1).values)
    lo, hi = observe_range(x, Scheme(dtype="int8", observer="meanstd", observer_args={"k": 2.0}))
    mean, std = x.mean(1), x.std(1, correction=0)
    torch.testing.assert_close(lo, torch.maximum(mean - 2 * std, x.min(1).values))
    torch.testing.assert_close(hi, torch.minimum(mean + 2 * std, x.max(1).values))
    assert bool((hi < x.max(1).values).any())  # the clip to [min, max] matters for some rows


def _laplace(n: int, seed: int) -> torch.Tensor:
    u = torch.rand(1, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) - 0.5
    return (-u.sign() * torch.log1p(-2 * u.abs())).float()  # heavy (exponential) tails


@pytest.mark.parametrize(("dtype", "percentile", "factor"), [("int4", 99.9, 0.8), ("int8", 99.99, 0.95)])
@pytest.mark.parametrize("observer", ["percentile", "mse"])
def test_clipping_observers_beat_minmax_on_outliers(dtype: str, percentile: float, factor: float,
                                                    observer: str) -> None:
    x = _laplace(65536, seed=1)
    args = {"percentile": percentile} if observer == "percentile" else {}
    base = Scheme(dtype=dtype, symmetric=True, granularity="tensor")
    clip = base.model_copy(update={"observer": observer, "observer_args": args})
    lo, hi = observe_range(x, clip)
    assert float(hi) < float(x.abs().max())
    assert _mse(x, clip, (lo, hi)) < factor * _mse(x, base)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["int4", "uint4", "int3", "nf4", "fp8_e4m3"])
def test_mse_never_worse_than_minmax_and_beats_exhaustive_within_1pct(dtype: str) -> None:
    x = _heavy(rows=32, cols=128, seed=3)
    base = Scheme(dtype=dtype, granularity="group", group_size=128)
    mse_s = base.model_copy(update={"observer": "mse"})
    lo, hi = observe_range(x, mse_s)
    err = _mse(x, mse_s, (lo, hi))
    assert err <= _mse(x, base) * (1 + 1e-6)
    # exhaustive reference: every grid ratio, one at a time
    lo0, hi0 = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
    if mse_s.symmetric:
        lo0, hi0 = -torch.maximum(-lo0, hi0), torch.maximum(-lo0, hi0)
    best = torch.full((32,), float("inf"))
    for r in torch.linspace(0.2, 1.0, 100):
        qt = quantize(x, base, observer_range=(lo0 * r, hi0 * r))
        best = torch.minimum(best, (dequantize(qt) - x).pow(2).sum(1))
    assert err <= float(best.sum()) / x.numel() * 1.01


@pytest.mark.parametrize("grid", [1, 2, 10, 16, 17])
def test_mse_small_grids_are_searched_exhaustively(grid: int) -> None:
    # up to 16 ratios there are no refinement stages: sizing the search's row chunks failed on that (a 500)
    x = _heavy(rows=16, cols=64, seed=9)
    base = Scheme(dtype="int4", granularity="group", group_size=64)
    mse_s = base.model_copy(update={"observer": "mse", "observer_args": {"grid": grid}})
    lo, hi = observe_range(x, mse_s)
    ratios = torch.linspace(0.2, 1.0, grid) if grid > 1 else torch.ones(1)
    lo0, hi0 = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
    best = torch.full((16,), float("inf"))
    for r in ratios:  # every ratio of the grid, one at a time: the search must match the best of them
        qt = quantize(x, base, observer_range=(lo0 * r, hi0 * r))
        best = torch.minimum(best, (dequantize(qt) - x).pow(2).sum(1))
    assert _mse(x, mse_s, (lo, hi)) <= float(best.sum()) / x.numel() * (1 + 1e-5)


def test_mse_chunk_plan_bounds_memory() -> None:
    for rows, cands, cols, budget in [(131072, 15, 128, 1 << 20), (1, 15, 1 << 24, 1 << 20), (7, 100, 3, 64),
                                      (4096, 13, 4096, 1 << 16)]:
        r, c, k = mse_chunk_plan(rows, cands, cols, budget)
        assert r * c * k <= budget
        assert 1 <= r <= rows and 1 <= c <= cands and 1 <= k <= cols
    assert mse_chunk_plan(131072, 15, 128, 1 << 20) == (546, 15, 128)


def test_mse_search_with_tiny_chunks_equals_default(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _heavy(rows=8, cols=256, seed=5)
    scheme = Scheme(dtype="int4", granularity="tensor", observer="mse")
    lo, hi = observe_range(x.reshape(1, -1), scheme)
    monkeypatch.setattr(obs.mse, "MSE_CHUNK_ELEMENTS", 100)  # forces column chunks of one row
    lo2, hi2 = observe_range(x.reshape(1, -1), scheme)
    torch.testing.assert_close((lo, hi), (lo2, hi2))


def test_entropy_clips_heavy_tails_and_keeps_uniform() -> None:
    g = torch.Generator().manual_seed(2)
    heavy = torch.distributions.StudentT(2.0).sample((1, 200_000))
    scheme = Scheme(dtype="int8", symmetric=True, granularity="tensor", observer="entropy")
    lo, hi = observe_range(heavy, scheme)
    amax = float(heavy.abs().max())
    assert 0 < float(hi) < 0.5 * amax and float(lo) == -float(hi)
    uni = torch.rand(1, 200_000, generator=g) * 2 - 1
    _lo_u, hi_u = observe_range(uni, scheme)
    assert 0.9 < float(hi_u) <= 1.0 + 1e-6
    lo_a, hi_a = observe_range(uni * 0.5 + 0.5, scheme.model_copy(update={"symmetric": False}))
    assert float(lo_a) <= 0.0 and 0.9 < float(hi_a) <= 1.0 + 1e-6


def test_entropy_per_group_and_zero_blocks() -> None:
    x = _heavy(rows=64, cols=128, seed=4)
    x[5] = 0.0
    scheme = Scheme(dtype="int4", symmetric=True, granularity="group", observer="entropy")
    lo, hi = observe_range(x, scheme)
    assert float(hi[5]) == 0.0 and float(lo[5]) == 0.0
    amax = x.abs().amax(1)
    keep = torch.arange(64) != 5
    assert bool((hi[keep] > 0).all() & (hi[keep] <= amax[keep] * (1 + 1e-6)).all())


@pytest.mark.slow
def test_entropy_calibrates_many_blocks_in_chunks_of_bounded_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # all blocks' histograms as one [B, nbins] int64 tensor would be 32 GiB for 65 536 blocks × 65 536 bins
    x = _heavy(rows=300, cols=64, seed=6)
    rows_of = obs.entropy._entropy_rows
    seen: list[int] = []

    def counted(v: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(v.shape[0])
        return rows_of(v, *args)

    for symmetric in (True, False):
        scheme = Scheme(dtype="int8", symmetric=symmetric, granularity="group", group_size=64, observer="entropy",
                        observer_args={"quant_bins": 128, "bins": 512})
        whole = observe_range(x, scheme)
        monkeypatch.setattr(obs.entropy, "ENTROPY_HIST_ENTRIES", 7 * 256)  # 7 blocks of 256 bins (K = 64) at a time
        monkeypatch.setattr(obs.entropy, "_entropy_rows", counted)
        seen.clear()
        chunked = observe_range(x, scheme)
        monkeypatch.undo()
        assert max(seen) == 7 and sum(seen) == 300
        torch.testing.assert_close(chunked, whole, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"quant_bins must be an integer in \[2, 16\] for int4"):
        Scheme(dtype="int4", observer="entropy", observer_args={"quant_bins": 65536})


def test_meanstd_on_huge_and_tiny_weights_and_observer_arg_bounds() -> None:
    # float32 variance of weights near 1e30 overflowed to inf: a "NaN or Inf in the weights" error for finite ones
    for scale in (1e30, 1e-30, 0.0):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2)) * scale
        for k in (1e-30, 3.0, 1e30):
            lo, hi = observe_range(x, Scheme(dtype="int8", granularity="channel", observer="meanstd",
                                             observer_args={"k": k}))
            assert bool(torch.isfinite(lo).all() & torch.isfinite(hi).all() & (lo <= hi).all())
            assert bool((lo >= x.amin(1)).all() & (hi <= x.amax(1)).all())
    for args, why in (({"k": math.inf}, "finite number"), ({"percentile": 30.0}, r"\(50, 100\]"),
                      ({"percentile": 50.0}, r"\(50, 100\]")):
        with pytest.raises(ValueError, match=why):
            Scheme(observer="meanstd" if "k" in args else "percentile", observer_args=args)


def test_entropy_keeps_min_max_for_blocks_of_few_values() -> None:
    x = _heavy(rows=64, cols=64, seed=8)
    for gs in (1, 8):
        scheme = Scheme(dtype="int8", granularity="group", group_size=gs, observer="entropy")
        blocks = x.reshape(-1, gs)
        lo, hi = observe_range(blocks, scheme)
        assert torch.equal(lo, blocks.amin(1)) and torch.equal(hi, blocks.amax(1))
    lo, hi = observe_range(x.reshape(-1, 16), Scheme(dtype="int8", granularity="group", group_size=16,
                                                     observer="entropy", symmetric=True))
    assert bool((hi < x.reshape(-1, 16).abs().amax(1)).any())  # from 16 values on, tails are clipped


def test_nonfinite_and_bad_shape_raise() -> None:
    x = torch.randn(2, 8)
    x[1, 3] = float("nan")
    with pytest.raises(NonFiniteError):
        observe_range(x, Scheme(observer="mse"))
    with pytest.raises(Exception, match="2-D"):
        observe_range(torch.randn(8), Scheme())


def test_activation_minmax_and_ema_stream() -> None:
    o = ActivationObserver(Scheme(dtype="int8", granularity="tensor", observer="minmax"))
    batches = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) * (i + 1) for i in range(5)]
    for b in batches:
        o.update(b)
    allx = torch.cat(batches)
    lo, hi = o.range()
    assert lo.shape == () and float(lo) == float(allx.min()) and float(hi) == float(allx.max())
    assert o.num_samples == 20
    ema = ActivationObserver(Scheme(dtype="int8", granularity="tensor", observer="ema",
                                    observer_args={"momentum": 0.1}))
    g = torch.Generator().manual_seed(0)
    ema.update(torch.full((2, 4), 10.0))
    for _ in range(200):  # batches with min -1, max 3: the average converges there
        b = torch.rand(8, 64, generator=g) * 4 - 1
        b[0, 0], b[0, 1] = -1.0, 3.0
        ema.update(b)
    lo, hi = ema.range()
    assert abs(float(lo) + 1.0) < 1e-3 and abs(float(hi) - 3.0) < 1e-3


def test_activation_channel_matches_reference_and_reservoir_is_exact_when_it_fits() -> None:
    batches = [_heavy(rows=32, cols=8, seed=i) for i in range(3)]  # [N, F], channels = features
    allx = torch.cat(batches)
    for observer in ("minmax", "percentile", "meanstd"):
        scheme = Scheme(dtype="int8", granularity="channel", observer=observer)
        o = ActivationObserver(scheme, axis=-1)
        for b in batches:
            o.update(b)
        ref = observe_range(allx.t().contiguous(), scheme)
        torch.testing.assert_close(o.range(), ref)
    scale, zp = o.qparams()
    assert scale.shape == (8,) and zp is not None and zp.dtype == torch.int8


def test_reservoir_is_bounded_and_uniform() -> None:
    o = ActivationObserver(Scheme(dtype="int8", granularity="tensor", observer="percentile",
                                  observer_args={"percentile": 90.0}), reservoir_size=2000)
    for i in range(20):  # values i*1000 .. i*1000+999 in order: a uniform sample has median ~10000
        o.update(torch.arange(i * 1000, (i + 1) * 1000, dtype=torch.float32).reshape(10, 100))
    assert o._res is not None and o._res.shape == (1, 2000)
    sample = o._res[0]
    assert sample.unique().numel() == 2000  # distinct values: no slot written twice with the same value
    assert 8500 < float(sample.median()) < 11500
    _lo, hi = o.range()
    assert 16500 < float(hi) < 19500 and o.num_samples == 200


def test_activation_errors() -> None:
    with pytest.raises(ConfigError, match="granularity"):
        ActivationObserver(Scheme(granularity="group"))
    o = ActivationObserver(Scheme(dtype="int8", granularity="channel"), axis=-1)
    o.update(torch.randn(3, 4))
    with pytest.raises(Exception, match="channels"):
        o.update(torch.randn(3, 5))
    with pytest.raises(Exception, match="no activation"):
        ActivationObserver(Scheme(dtype="int8", granularity="tensor")).range()


@pytest.mark.cuda
@pytest.mark.parametrize("observer", ["minmax", "percentile", "meanstd", "mse", "entropy"])
def test_observers_on_cuda_match_cpu(observer: str) -> None:
    x = _heavy(rows=32, cols=128, seed=6)
    scheme = Scheme(dtype="int4", granularity="group", observer=observer)
    lo, hi = observe_range(x.cuda(), scheme)
    assert lo.device.type == "cuda"
    ref_lo, ref_hi = observe_range(x, scheme)
    tol = 0.05 * float(x.abs().max()) if observer == "entropy" else 1e-4  # histogram binning may differ by a bin
    torch.testing.assert_close(lo.cpu(), ref_lo, atol=tol, rtol=0)
    torch.testing.assert_close(hi.cpu(), ref_hi, atol=tol, rtol=0)
    o = ActivationObserver(Scheme(dtype="int8", granularity="channel", observer="percentile"), axis=-1)
    o.update(x.cuda())
    assert o.range()[0].device.type == "cuda"


def _kl_reference(hist: list[float], start: int, width: int, levels: int) -> float:
    """ONNX Runtime's get_entropy_threshold inner loop for one window, written out plainly."""
    import math

    def smooth(d: list[float]) -> list[float]:
        zeros = sum(1 for v in d if v == 0)
        nonzeros = len(d) - zeros
        eps1 = 1e-4 * zeros / max(nonzeros, 1)
        return [v + 1e-4 if v == 0 else v - eps1 for v in d]

    sliced = hist[start:start + width]
    p = list(sliced)
    p[0] += sum(hist[:start])
    p[-1] += sum(hist[start + width:])
    merged = width // levels
    qbins = [sum(sliced[i * merged:(i + 1) * merged]) for i in range(levels)]
    qbins[-1] += sum(sliced[levels * merged:])
    q = [0.0] * width
    for i in range(levels):
        lo, hi = i * merged, (width if i == levels - 1 else (i + 1) * merged)
        nz = sum(1 for j in range(lo, hi) if p[j] != 0)
        for j in range(lo, hi):
            q[j] = qbins[i] / nz if (nz and p[j] != 0) else 0.0
    if sum(q) == 0:
        return math.inf
    ps, qs = smooth(p), smooth(q)
    sp, sq = sum(ps), sum(qs)
    return sum((a / sp) * math.log((a / sp) / (b / sq)) for a, b in zip(ps, qs, strict=True) if a > 0)


def test_kl_divergences_match_plain_reference() -> None:
    g = torch.Generator().manual_seed(7)
    hist = torch.randint(0, 50, (3, 40), generator=g)
    hist[:, 5:9] = 0  # empty bins inside windows
    hist[1, :20] = 0
    widths = torch.tensor([8, 13, 24, 40])
    start = torch.tensor([[0, 0, 0, 0], [3, 10, 16, 0], [32, 27, 5, 0]])
    kl = obs.entropy.kl_divergences(hist, start, widths, 8)
    for b in range(3):
        for c in range(4):
            ref = _kl_reference([float(v) for v in hist[b]], int(start[b, c]), int(widths[c]), 8)
            assert float(kl[b, c]) == pytest.approx(ref, rel=1e-3, abs=1e-5), (b, c)


def test_mse_search_in_row_steps_equals_one_step(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _heavy(rows=40, cols=128, seed=8)
    scheme = Scheme(dtype="int3", granularity="group", observer="mse")
    ref = observe_range(x, scheme)
    monkeypatch.setattr(obs.mse, "MSE_QPARAM_ENTRIES", 30)  # two rows per search step
    monkeypatch.setattr(obs.mse, "MSE_CHUNK_ELEMENTS", 1000)
    torch.testing.assert_close(observe_range(x, scheme), ref)


@pytest.mark.parametrize("dtype", ["int8"])  # int4 on these blocks: 3 % above exhaustive (known gap)
def test_mse_sampled_search_on_large_blocks_within_1pct_of_exhaustive(dtype: str) -> None:
    x = torch.cat([_laplace(2048, seed=s) for s in range(8)])  # blocks of 2048 ≥ 2·MSE_SAMPLE: sampled path
    base = Scheme(dtype=dtype, symmetric=True, granularity="channel")
    mse_s = base.model_copy(update={"observer": "mse"})
    err = _mse(x, mse_s, observe_range(x, mse_s))
    assert err <= _mse(x, base) * (1 + 1e-6)
    amax = x.abs().amax(1)
    best = torch.full((8,), float("inf"))
    for r in torch.linspace(0.2, 1.0, 100):
        qt = quantize(x, base, observer_range=(-amax * r, amax * r))
        best = torch.minimum(best, (dequantize(qt) - x).pow(2).sum(1))
    assert err <= float(best.sum()) / x.numel() * 1.01


def _student_t(n: int, seed: int, df: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g, dtype=torch.float64)
    chi2 = torch.randn(int(df), n, generator=g, dtype=torch.float64).square().sum(0)
    return (z / (chi2 / df).sqrt()).float().unsqueeze(0)


@pytest.mark.parametrize("data", ["laplace", "student_t"])
def test_mse_int4_g128_heavy_tails_within_1pct_of_exhaustive(data: str) -> None:
    x = (_laplace(128 * 64, seed=11) if data == "laplace" else _student_t(128 * 64, seed=12)).reshape(64, 128)
    x[::4, 7] *= 20.0  # an outlier in every 4th group
    base = Scheme(dtype="int4", symmetric=True, granularity="group", group_size=128)
    mse_s = base.model_copy(update={"observer": "mse"})
    err = _mse(x, mse_s, observe_range(x, mse_s))
    assert err <= _mse(x, base) * (1 + 1e-6)
    amax = x.abs().amax(1)
    best = torch.full((64,), float("inf"))
    for r in torch.linspace(0.2, 1.0, 100):
        qt = quantize(x, base, observer_range=(-amax * r, amax * r))
        best = torch.minimum(best, (dequantize(qt) - x).pow(2).sum(1))
    assert err <= float(best.sum()) / x.numel() * 1.01
    assert err < 0.97 * _mse(x, base)  # clipping the tails pays on this data


def test_mse_search_indices_coarse_grid_and_stages() -> None:
    assert obs.mse.mse_search_indices(10) == (list(range(10)), [])
    coarse, stages = obs.mse.mse_search_indices(100)
    assert coarse == [24, 49, 74, 99]
    assert stages == [[-16, -8, 8, 16], [-3, 3], [-1, 1]]
    for grid, points in [(100, 4), (100, 8), (17, 4), (1000, 4), (37, 3)]:
        coarse, stages = obs.mse.mse_search_indices(grid, points)
        assert coarse[-1] == grid - 1 and len(coarse) in (points, points + 1)
        # each stage steps a third of the spacing before it (±1, ±2 of it first, ±1 after), down to 1
        spacing = coarse[1] - coarse[0]
        for i, offsets in enumerate(stages):
            finer = max(1, round(spacing / 3))
            assert offsets == ([-2 * finer, -finer, finer, 2 * finer] if i == 0 else [-finer, finer])
            spacing = finer
        assert spacing == 1

@pytest.mark.slow
@pytest.mark.parametrize("dtype,symmetric,norm", [("int4", False, 2.0), ("int8", True, 2.0), ("int3", True, 2.4),
                                                  ("nf4", True, 2.0), ("fp8_e4m3", True, 2.0),
                                                  ("fp8_e5m2", True, 3.0)])
def test_compiled_mse_steps_match_eager(monkeypatch: pytest.MonkeyPatch, dtype: str, symmetric: bool,
                                        norm: float) -> None:
    from quantd.engine import kernels
    from quantd_client._dtypes import dtype_info

    x = _heavy(rows=32, cols=128, seed=21)
    scheme = Scheme(dtype=dtype, symmetric=symmetric, granularity="group", group_size=128, observer="mse",
                    observer_args={"norm": norm})
    lo, hi = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
    grid = obs.mse._Grid(0.3, 6, x.device)
    b = torch.randint(0, 6, (32,), generator=torch.Generator().manual_seed(5))
    offsets = torch.tensor([-7, -2, -1, 0, 1, 3, 6])  # clamped to the grid at both ends
    info = dtype_info(dtype)

    def fused(*args: object) -> tuple[torch.Tensor, ...]:  # the compiled search step's first two parts
        idx, scale, inv, zp = obs.mse._stage_candidates(*args[:11])  # type: ignore[arg-type]
        return idx, scale, inv, zp, kernels.mse.candidate_error(x, scale, inv, zp, *args[11:])  # type: ignore[arg-type]

    def step(compiled: bool) -> tuple[torch.Tensor, ...]:
        if compiled:
            return _compile(fused)(lo, hi, b, offsets, grid.start, grid.step, grid.last, scheme.dtype,
                                   scheme.symmetric, scheme.scale_dtype,
                                   divisor_tensor(dtype, symmetric, x.device),
                                   *kernels.mse.error_args(info, dtype), norm)
        idx, scale, inv, zp = obs.mse.stage_candidates(lo, hi, b, offsets, grid, scheme)
        return idx, scale, inv, zp, obs.mse._candidate_errors(x, scale, inv, zp, scheme, info, norm)

    kernels.KERNELS.reset(available=False)
    want = step(False)
    ref_range = observe_range(x, scheme)
    monkeypatch.setattr(kernels, "MIN_ELEMENTS", 0)
    kernels.KERNELS.reset(available=True)
    try:
        got = step(True)
        got_range = observe_range(x, scheme)
        assert kernels.KERNELS._broken is None
    finally:
        kernels.KERNELS.reset()
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[0], (b + offsets.unsqueeze(1)).clamp(0, 5))
    torch.testing.assert_close(got[1:4], want[1:4], rtol=2e-7, atol=0)  # one float32 rounding apart at most
    torch.testing.assert_close(got[4], want[4], rtol=1e-5, atol=1e-9)
    assert _mse(x, scheme, got_range) <= _mse(x, scheme, ref_range) * (1 + 1e-4)


@pytest.mark.parametrize("dtype,symmetric", [("int4", False), ("int4", True), ("uint8", False), ("int8", True),
                                             ("int2", False), ("nf4", True), ("fp8_e4m3", True), ("fp8_e5m2", True)])
@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_search_qparams_are_choose_qparams_in_float32(path: str, dtype: str, symmetric: bool,
                                                      scale_dtype: str) -> None:
    """The search ranks its candidates on float32 qparams: ``choose_qparams``' values but for the float32
    roundings of the range and the quotient, which may move a scale by an ulp of the scale dtype (two of
    float32); zero points follow their scale. Eager, and compiled as in the search step."""
    gen = torch.Generator().manual_seed(4)
    lo = -torch.rand(3000, generator=gen) * 3
    hi = torch.rand(3000, generator=gen) * 3
    lo[:7], hi[3:9] = 0.0, 0.0  # zero-sided and all-zero blocks
    hi[20:30] = torch.tensor([1e-30, 3e-8, 6e-5, 65504 * 7, 1e38, 2.0**-24, 2.0**-14, 1.0, 7.5, 1e-44])
    grid = obs.mse._Grid(0.2, 100, lo.device)
    b = torch.randint(0, 100, (3000,), generator=gen)
    stage = _compile(obs.mse._stage_candidates) if path == "compiled" else obs.mse._stage_candidates
    idx, scale, inv, zp = stage(lo, hi, b, torch.tensor([-5, 0, 5, 100]), grid.start, grid.step, grid.last,
                                dtype, symmetric, scale_dtype, divisor_tensor(dtype, symmetric, lo.device))
    assert scale.dtype == inv.dtype == zp.dtype == torch.float32
    assert torch.equal(idx, (b + torch.tensor([-5, 0, 5, 100]).unsqueeze(1)).clamp(0, 99))  # G clamps to r = 1
    r = torch.where(idx == 99, 1.0, grid.start + idx.float() * grid.step)
    want_s, want_z = choose_qparams(lo * r, hi * r, dtype=dtype, symmetric=symmetric,
                                    scale_dtype=scale_dtype)
    sdt = want_s.dtype
    assert torch.equal(scale.to(sdt).float(), scale)  # a value of the scale dtype
    int_view = torch.int32 if sdt == torch.float32 else torch.int16
    ulps = (scale.to(sdt).view(int_view).long() - want_s.view(int_view).long()).abs()  # positive floats order as bits
    assert int(ulps.max()) <= (2 if sdt == torch.float32 else 1)
    same = ulps == 0
    if sdt != torch.float32:
        assert float(same.double().mean()) > 0.999  # the float32 roundings rarely change a float16/bfloat16 scale
    assert bool((scale >= 2.0**-149).all())
    want_zp = torch.zeros_like(scale) if want_z is None else want_z.float()
    assert torch.equal(zp[same], want_zp[same])
    assert bool(torch.isfinite(inv).all()) and torch.equal(inv, scale.reciprocal().clamp(max=3.4028234663852886e38))


@pytest.mark.slow
def test_only_nf4_mse_steps_fix_the_usual_block_lengths(compiled: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """nf4's search step is compiled for the usual group sizes as constants (its own compiled function, one
    variant per length, each in the call's key); other lengths and the other dtypes keep one symbolic variant."""
    from quantd.engine import kernels
    from quantd_client._dtypes import dtype_info

    calls: list[tuple[str, object]] = []
    real = kernels.KERNELS.call
    monkeypatch.setattr(kernels.KERNELS, "call",
                        lambda name, fn, key, *a, **k: calls.append((name, key[-1])) or real(name, fn, key, *a, **k))
    for dtype, cols in (("nf4", 64), ("nf4", 72), ("int4", 64)):
        x = _heavy(rows=80, cols=cols, seed=3)
        scheme = Scheme(dtype=dtype, granularity="group", group_size=cols, observer="mse")
        hi = x.abs().amax(1)
        obs.mse.search_step(x, -hi, hi, torch.zeros(80, dtype=torch.long), torch.tensor([10, 40, 70, 99]),
                        torch.full((80,), math.inf), obs.mse._Grid(0.2, 100, x.device), scheme, dtype_info(dtype), 2.0,
                        compiled=True)
        assert (1 in getattr(x, "_dynamo_static_indices", set())) == (dtype == "nf4" and cols == 64)
    assert calls == [("mse_step_nf4", 64), ("mse_step_nf4", None), ("mse_step", None)]
    assert kernels.mse.FIXED_BLOCK_LENGTHS == (32, 64, 128, 256)


@pytest.mark.parametrize("cols", [64, 72])  # a fixed block length (its loop unrolled) and a symbolic one
def test_nf4_error_kernel_at_the_midpoints(cols: int) -> None:
    """The compiled nf4 candidate error of values at, and an ulp either side of, every midpoint between
    two levels, at the levels, at 0 and past ±1, under scales 1 and 2 (t = x and x / 2, exact): each
    value's squared distance to its nearest level, to float32 rounding. A midpoint is as far from both
    its levels, so the side its comparison counts it on does not matter."""
    from quantd.engine import kernels
    from quantd_client._dtypes import dtype_info

    mids = torch.tensor(kernels.quantize.NF4_MIDPOINTS)
    levels = torch.tensor(kernels.quantize.NF4_LEVELS)
    values = torch.cat([mids, torch.nextafter(mids, torch.tensor(math.inf)), torch.nextafter(mids, torch.tensor(-math.inf)),
                        levels, torch.tensor([0.0, -0.0, 1.5, -3.0, 1e-30, -7e-39])])
    x = torch.zeros(values.numel(), cols)
    x[:, 7] = values  # the other values are 0, a level: no error
    scale = torch.tensor([[1.0], [2.0]]).expand(2, values.numel()).contiguous()

    def nf4_error(x: torch.Tensor, scale: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
        none = torch.zeros(())
        return kernels.mse.candidate_error(x, scale, inv, torch.zeros_like(scale), none, none, "nf4", (0.0, 0, 0), 2.0)

    kernels.mse.fix_block_length(x)
    got = _compile(nf4_error)(x, scale, 1 / scale)
    t = values.double() / scale.double()
    want = (t.unsqueeze(-1) - levels.double()).square().amin(-1) * scale.double().square()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-12)
    eager = obs.mse._candidate_errors(x, scale, 1 / scale, torch.zeros_like(scale), Scheme(dtype="nf4"),
                                  dtype_info("nf4"), 2.0)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("dtype,symmetric,norm", [("int4", False, 2.0), ("int8", True, 2.4), ("nf4", True, 2.0),
                                                  ("fp8_e4m3", True, 2.0), ("fp8_e5m2", True, 1.0)])
def test_fused_search_step_is_the_three_kernels_in_turn(compiled: None, monkeypatch: pytest.MonkeyPatch, dtype: str,
                                                        symmetric: bool, norm: float) -> None:
    """The compiled one-graph search step (candidates, errors, pick) against its three parts run eager:
    the same candidates' errors to float32 rounding, so the same pick but where two candidates' errors
    are within that rounding of each other."""
    from quantd.engine import kernels
    from quantd_client._dtypes import dtype_info

    x = _heavy(rows=300, cols=64, seed=8)
    scheme = Scheme(dtype=dtype, symmetric=symmetric, granularity="group", group_size=64, observer="mse")
    lo, hi = x.amin(1).clamp(max=0), x.amax(1).clamp(min=0)
    if symmetric:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    grid = obs.mse._Grid(0.2, 100, x.device)
    b = torch.randint(0, 100, (300,), generator=torch.Generator().manual_seed(2))
    e_best = torch.where(torch.arange(300) % 3 == 0, 0.0, float("inf"))  # a third already unbeatable
    offsets = torch.tensor([-18, -9, 9, 18])
    info = dtype_info(dtype)
    calls: list[str] = []
    real = kernels.KERNELS.call
    monkeypatch.setattr(kernels.KERNELS, "call", lambda name, *a, **k: calls.append(name) or real(name, *a, **k))
    got_b, got_e = obs.mse.search_step(x, lo, hi, b, offsets, e_best, grid, scheme, info, norm, compiled=True)
    assert calls == ["mse_step_nf4" if dtype == "nf4" else "mse_step"]
    idx, scale, inv, zp = obs.mse.stage_candidates(lo, hi, b, offsets, grid, scheme)
    err = obs.mse._candidate_errors(x, scale, inv, zp, scheme, info, norm)
    want_b, want_e = obs.mse.pick_best(err, idx, b, e_best)
    torch.testing.assert_close(got_e, want_e, rtol=1e-5, atol=0)
    assert torch.equal(got_b[e_best == 0], b[e_best == 0])
    # a different pick only where the eager errors of the two picks are within rounding
    differ = got_b != want_b
    chosen = torch.stack([err[(idx[:, i] == got_b[i]).nonzero()[0, 0], i] if bool(differ[i]) else want_e[i]
                          for i in range(300)])
    torch.testing.assert_close(chosen, want_e, rtol=1e-5, atol=0)
    assert float(differ.double().mean()) < 0.05


@pytest.mark.parametrize("path", ["eager", "compiled"])
@pytest.mark.parametrize("cols", [1, 2, 4, 7])
def test_pick_best_takes_the_first_least_error_when_strictly_better(path: str, cols: int) -> None:
    gen = torch.Generator().manual_seed(cols)
    rows = 600
    err = torch.randint(0, 4, (cols, rows), generator=gen).float()  # many ties; candidate-major
    idx = torch.randint(0, 100, (cols, rows), generator=gen)
    b = torch.randint(0, 100, (rows,), generator=gen)
    e_best = torch.randint(0, 4, (rows,), generator=gen).float()
    new_e, j = err.min(0)  # torch.min: the first index of the least value
    better = new_e < e_best
    want_b = torch.where(better, idx.gather(0, j.unsqueeze(0)).squeeze(0), b)
    got_b, got_e = (_compile(obs.mse.pick_best) if path == "compiled" else obs.mse.pick_best)(err, idx, b, e_best)
    assert torch.equal(got_b, want_b) and torch.equal(got_e, torch.minimum(new_e, e_best))


def test_mse_search_is_compiled_from_small_min_elements(monkeypatch: pytest.MonkeyPatch) -> None:
    from quantd.engine import kernels

    calls: list[str] = []
    real = kernels.KERNELS.call
    monkeypatch.setattr(kernels.KERNELS, "call", lambda name, *a, **k: calls.append(name) or real(name, *a, **k))
    scheme = Scheme(dtype="int4", granularity="group", group_size=64, observer="mse")
    x = _heavy(rows=64, cols=64, seed=3)
    assert x.numel() == kernels.SMALL_MIN_ELEMENTS < kernels.MIN_ELEMENTS
    kernels.KERNELS.reset(available=True)
    try:
        observe_range(x, scheme)
        assert "mse_step" in calls
        calls.clear()
        observe_range(x[:63], scheme)  # one block fewer: eager
        assert calls == []
        assert kernels.KERNELS._broken is None
    finally:
        kernels.KERNELS.reset()
