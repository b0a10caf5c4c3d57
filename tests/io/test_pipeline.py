"""quantize_file / analyze_file / calibrate_file end to end, on small files."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import quantd.engine.primitives as primitives
from quantd.engine.stats import error_stats
from quantd.errors import ConfigError, JobCancelled, MalformedInputError, NonFiniteError
from quantd.io import analyze_file, dequantize_artifact, load_into_model, open_model, plan, quantize_file
from quantd_client import Progress, QuantConfig, Scheme
from quantd_client._artifact import read_artifact


def _model_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "layer.0.weight": torch.randn(32, 64, generator=g),
        "layer.0.bias": torch.randn(32, generator=g),
        "layer.1.weight": torch.randn(16, 32, generator=g).bfloat16(),
        "layer.2.weight": torch.randn(16, 64, generator=g).half(),
        "layer.3.weight": torch.randn(8, 32, generator=g, dtype=torch.float64),
        "conv.weight": torch.randn(8, 4, 3, 3, generator=g) * 0.1,
        "position_ids": torch.arange(12, dtype=torch.int64).reshape(1, 12),
    }


CONFIG = QuantConfig(
    scheme=Scheme(dtype="int4", group_size=32),
    rules=[{"match": "conv.*", "scheme": {"dtype": "int8", "granularity": "channel"}},
           {"match": "layer.3.*", "scheme": {"dtype": "fp8_e4m3", "granularity": "channel"}}],
)


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    p = tmp_path / "model.safetensors"
    save_file(_model_tensors(), str(p))
    return p


def test_quantize_file_round_trip(tmp_path: Path, model_file: Path) -> None:
    src = _model_tensors()
    dst = tmp_path / "out.safetensors"
    seen: list[Progress] = []
    report = quantize_file(model_file, dst, CONFIG, device="cpu", job_id="j1", on_progress=seen.append)
    assert report.job_id == "j1" and report.config == CONFIG
    by_name = {t.name: t for t in report.tensors}
    assert set(by_name) == set(src)
    assert by_name["layer.0.bias"].skipped and "skip_1d" in (by_name["layer.0.bias"].reason or "")
    assert by_name["position_ids"].skipped and by_name["position_ids"].in_dtype == "int64"
    assert by_name["layer.1.weight"].in_dtype == "bfloat16"
    assert by_name["conv.weight"].scheme is not None and by_name["conv.weight"].scheme.dtype == "int8"
    quantized = [t for t in report.tensors if not t.skipped]
    assert len(quantized) == 5

    # progress: once before, once per tensor, monotone, ending at 1
    assert [p.tensors_done for p in seen] == list(range(len(src) + 1))
    assert seen[-1].fraction == 1.0 and seen[-1].bytes_done == seen[-1].bytes_total
    assert all(a.bytes_done <= b.bytes_done for a, b in itertools.pairwise(seen))

    # the artifact reproduces every reported statistic
    deq = dequantize_artifact(dst, dtype=torch.float64)
    for t in quantized:
        x = src[t.name].double()
        mse = float(((deq[t.name] - x) ** 2).mean())
        assert t.stats is not None
        assert mse == pytest.approx(t.stats.mse, rel=1e-5, abs=1e-12)
        assert t.stats.sqnr_db == pytest.approx(10 * math.log10(float((x**2).mean()) / mse), rel=1e-5)
    with safe_open(str(dst), framework="pt") as f:
        assert torch.equal(f.get_tensor("position_ids"), src["position_ids"])
        assert torch.equal(f.get_tensor("layer.0.bias"), src["layer.0.bias"])
        meta = json.loads(f.metadata()["quantd"])

    s = report.summary
    assert meta["summary"] == json.loads(s.model_dump_json())
    assert s.tensors_quantized == 5 and s.tensors_skipped == 2 and s.device == "cpu"
    # input/output bytes are the files' sizes (as Job.input.bytes and Job.result.artifact_bytes)
    assert s.input_bytes == Path(model_file).stat().st_size
    assert s.output_bytes == dst.stat().st_size
    for t in quantized:  # every quantized tensor's stats travel in the artifact's metadata too
        assert meta["tensors"][t.name]["stats"] == json.loads(t.stats.model_dump_json())
    assert s.compression_ratio == pytest.approx(s.input_bytes / s.output_bytes)
    numels = {t.name: src[t.name].numel() for t in quantized}
    bpw = sum(numels[t.name] * t.stats.bits_per_weight for t in quantized if t.stats) / sum(numels.values())
    assert s.bits_per_weight == pytest.approx(bpw)
    sq = {t.name: t.stats.sqnr_db for t in quantized if t.stats and t.stats.sqnr_db is not None}
    assert s.min_sqnr_db == pytest.approx(min(sq.values()))
    assert s.mean_sqnr_db == pytest.approx(sum(sq.values()) / len(sq))
    assert s.worst_tensor == min(sq, key=lambda k: sq[k])

    # and the NumPy SDK agrees with the torch reader
    sdk = read_artifact(dst).dequantize()
    for t in quantized:
        np.testing.assert_allclose(sdk[t.name], deq[t.name].float().numpy(), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["pytorch", "npz", "npy"])
def test_every_format_quantizes(tmp_path: Path, fmt: str) -> None:
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    src = tmp_path / "upload"
    if fmt == "pytorch":
        torch.save({"state_dict": {"w": w, "step": 7}}, src)
    elif fmt == "npz":
        with src.open("wb") as f:
            np.savez(f, w=w.numpy())
    else:
        with src.open("wb") as f:
            np.save(f, w.numpy())
    dst = tmp_path / "out.safetensors"
    report = quantize_file(src, dst, QuantConfig(scheme=Scheme(dtype="int8", granularity="channel")),
                           device="cpu", filename="w.npy")
    (t,) = report.tensors
    assert t.name == "w" and not t.skipped
    assert t.stats is not None and t.stats.sqnr_db is not None and t.stats.sqnr_db > 35
    assert read_artifact(dst).quantized == ["w"]


def test_min_numel_holds_over_rules_and_skip_1d_yields_to_them(tmp_path: Path, model_file: Path) -> None:
    # CONTRACT §1: tensors below min_numel stay as they are; only skip_1d is "unless a rule says otherwise"
    config = QuantConfig(scheme=Scheme(dtype="int4", group_size=32), min_numel=600,
                         rules=[{"match": "layer.*", "scheme": {"dtype": "int8", "granularity": "channel"}}])
    report = quantize_file(model_file, tmp_path / "out.safetensors", config, device="cpu")
    by_name = {t.name: t for t in report.tensors}
    assert by_name["layer.0.bias"].skipped and "min_numel" in (by_name["layer.0.bias"].reason or "")  # 32 < 600
    assert by_name["layer.1.weight"].skipped and "min_numel" in (by_name["layer.1.weight"].reason or "")  # 512
    kept = by_name["layer.2.weight"].scheme  # 1024 elements
    assert kept is not None and kept.dtype == "int8"
    ruled_1d = QuantConfig(rules=[{"match": "*.bias", "scheme": {"dtype": "int8", "granularity": "tensor"}}])
    assert ruled_1d.scheme_for("layer.0.bias", (16,))[0] is not None
    assert ruled_1d.scheme_for("norm.weight", (16,)) == (None, "1-D tensor (skip_1d)")


def test_a_rule_with_a_group_size_asks_for_groups() -> None:
    # Under a per-channel default, {"dtype": "int4", "group_size": 64} gave int4 per channel (SQNR 18.5 dB)
    # with the report still saying group_size 64. A rule that also names a granularity keeps it.
    cfg = QuantConfig(scheme={"dtype": "int8", "granularity": "channel"},
                      rules=[{"match": "lm_head.*", "scheme": {"dtype": "int4", "group_size": 64}},
                             {"match": "x.*", "scheme": {"group_size": 64, "granularity": "tensor"}}])
    head = cfg.scheme_for("lm_head.weight", (128, 256))[0]
    assert head is not None and (head.granularity, head.group_size) == ("group", 64)
    x = cfg.scheme_for("x.weight", (128, 256))[0]
    assert x is not None and x.granularity == "tensor"
    other = cfg.scheme_for("w", (128, 256))[0]
    assert other is not None and other.granularity == "channel"


@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.float8_e4m3fn, torch.uint16, torch.int32])
def test_a_file_with_nothing_to_quantize_passes_through(tmp_path: Path, dtype: torch.dtype) -> None:
    # the summary's bits per weight came from a table of the schemas' dtypes: a KeyError (500) for float8/uint16
    src = tmp_path / "m.safetensors"
    w = torch.randn(16, 32).clamp(-100, 100).to(dtype) if dtype.is_floating_point else torch.arange(512).to(dtype)
    save_file({"w": w}, str(src))
    report = quantize_file(src, tmp_path / "out.safetensors", QuantConfig(), device="cpu")
    assert report.summary.tensors_quantized == 0 and report.summary.tensors_skipped == 1
    assert report.summary.bits_per_weight == dtype.itemsize * 8
    with safe_open(str(tmp_path / "out.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("w").view(torch.uint8), w.view(torch.uint8))


def test_config_error_before_any_work(tmp_path: Path, model_file: Path) -> None:
    src = tmp_path / "odd.safetensors"
    save_file(_model_tensors() | {"odd.weight": torch.randn(4, 40)}, str(src))
    dst = tmp_path / "out.safetensors"
    with pytest.raises(ConfigError) as ei:
        quantize_file(src, dst, CONFIG, device="cpu")
    assert ei.value.field == "group_size" and ei.value.tensor == "odd.weight"
    assert "'odd.weight'" in str(ei.value) and "group_size" in str(ei.value)
    assert not dst.exists() and not dst.with_name("out.safetensors.tmp").exists()
    with open_model(model_file) as r, pytest.raises(ConfigError, match="axis"):
        plan(r.tensors, QuantConfig(scheme=Scheme(dtype="int8", granularity="channel", axis=5)))


def test_output_name_collision(tmp_path: Path) -> None:
    p = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(4, 8), "w.scale": torch.randn(4)}, str(p))  # 1-D: kept as is
    with open_model(p) as r, pytest.raises(ConfigError, match=r"'w\.scale'"):
        plan(r.tensors, QuantConfig(scheme=Scheme(dtype="int8", granularity="channel")))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_named(tmp_path: Path, bad: float) -> None:
    t = _model_tensors()
    t["layer.2.weight"][3, 5] = bad
    p = tmp_path / "m.safetensors"
    save_file(t, str(p))
    dst = tmp_path / "out.safetensors"
    with pytest.raises(NonFiniteError, match=r"'layer\.2\.weight'") as ei:
        quantize_file(p, dst, CONFIG, device="cpu")
    assert ei.value.tensor == "layer.2.weight"
    assert not dst.exists() and not dst.with_name("out.safetensors.tmp").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_non_finite_in_a_tensor_kept_as_it_is_is_refused_too(tmp_path: Path, dtype: torch.dtype) -> None:
    """A kept norm or bias with NaN/Inf is a NonFiniteError naming it (CONTRACT §2); nothing is written."""
    p = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(4, 32), "b": torch.tensor([float("inf"), 1.0], dtype=dtype)}, str(p))
    with pytest.raises(NonFiniteError, match=r"tensor 'b': 1 of 2 values are NaN or Inf"):
        quantize_file(p, tmp_path / "o.safetensors", CONFIG, device="cpu")
    assert not (tmp_path / "o.safetensors").exists()
    big = tmp_path / "big.safetensors"  # finite float64 values whose sum overflows are no NaN
    save_file({"w": torch.randn(4, 32), "b": torch.tensor([1e308, 1e308], dtype=torch.float64)}, str(big))
    report = quantize_file(big, tmp_path / "o2.safetensors", CONFIG, device="cpu")
    assert {t.name: t.skipped for t in report.tensors} == {"w": False, "b": True}
    assert read_artifact_torch_free(tmp_path / "o2.safetensors", "b")[0] == 1e308


def read_artifact_torch_free(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name)


def test_cancel_between_tensors(tmp_path: Path, model_file: Path) -> None:
    dst = tmp_path / "out.safetensors"
    seen: list[Progress] = []

    def should_cancel() -> bool:
        return len(seen) >= 3  # the initial report and two tensors

    with pytest.raises(JobCancelled, match="2 of 7"):
        quantize_file(model_file, dst, CONFIG, device="cpu", on_progress=seen.append, should_cancel=should_cancel)
    assert seen[-1].tensors_done == 2
    assert not dst.exists() and not dst.with_name("out.safetensors.tmp").exists()


def test_device_oom_propagates(tmp_path: Path, model_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def oom(*a: object, **k: object) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(primitives, "quantize", oom)
    dst = tmp_path / "out.safetensors"
    with pytest.raises(torch.cuda.OutOfMemoryError):
        quantize_file(model_file, dst, CONFIG, device="cpu")
    assert not dst.with_name("out.safetensors.tmp").exists()


def test_analyze_file(model_file: Path) -> None:
    schemes = [Scheme(dtype="int8", granularity="channel"), Scheme(dtype="int4", group_size=4),
               Scheme(dtype="nf4", group_size=4)]
    resp = analyze_file(model_file, schemes, device="cpu")
    with open_model(model_file) as r:
        order = [t.name for t in r.tensors if len(t.shape) >= 2 and t.dtype != "int64"]
    assert [t.name for t in resp.tensors] == order
    assert set(order) == {"conv.weight", "layer.0.weight", "layer.1.weight", "layer.2.weight", "layer.3.weight"}
    src = _model_tensors()
    for t in resp.tensors:
        assert [r.scheme for r in t.results] == schemes
        x = src[t.name]
        for r in t.results:
            qt = primitives.quantize(x, r.scheme, name=t.name)
            expect = error_stats(x, primitives.dequantize(qt), qt)
            assert r.stats.mse == pytest.approx(expect.mse, rel=1e-6)
        sq = [r.stats.sqnr_db for r in t.results]
        assert sq[0] is not None and sq[1] is not None and sq[0] > sq[1]  # 8 bits beat 4 bits
    with pytest.raises(ConfigError, match="group_size"):
        analyze_file(model_file, [Scheme(dtype="int4", group_size=7)], device="cpu")
    # which of the configs, and when the analyses fail, that it is them (they run on configs[0])
    with pytest.raises(ConfigError, match=r"^configs\[1\]: field 'group_size'"):
        analyze_file(model_file, [Scheme(dtype="int8", granularity="channel"), Scheme(dtype="int4", group_size=7)],
                     device="cpu")
    with pytest.raises(ConfigError, match=r"^analyses \(of configs\[0\]\): field 'dtype'"):
        analyze_file(model_file, [Scheme(dtype="float16")], device="cpu", analyses=["scale_sensitivity"])


def test_analyze_file_of_vectors_only_analyzes_them(tmp_path: Path) -> None:
    """A file with no float tensor of ≥ 2 dims (a lone ``.npy`` vector) gets statistics for its 1-D
    tensors, not an empty answer; with a matrix beside them, they are left out."""
    v = np.random.default_rng(0).standard_normal(256).astype(np.float32)
    np.save(tmp_path / "v.npy", v)
    resp = analyze_file(tmp_path / "v.npy", [Scheme(dtype="int8", granularity="tensor")], device="cpu")
    assert [(t.name, t.shape) for t in resp.tensors] == [("v", [256])]
    assert resp.tensors[0].results[0].stats.numel == 256
    save_file({"b": torch.from_numpy(v), "w": torch.randn(4, 64)}, str(tmp_path / "m.safetensors"))
    resp = analyze_file(tmp_path / "m.safetensors", [Scheme(dtype="int8", granularity="tensor")], device="cpu")
    assert [t.name for t in resp.tensors] == ["w"]


def test_load_into_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    src = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(src))
    dst = tmp_path / "q.safetensors"
    quantize_file(src, dst, QuantConfig(scheme=Scheme(dtype="int8", granularity="channel")), device="cpu")
    fresh = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    load_into_model(fresh, dst)
    assert torch.equal(fresh[0].bias, model[0].bias)  # 1-D: passed through exactly
    assert not torch.equal(fresh[0].weight, model[0].weight)  # quantized: changed, but close
    x = torch.randn(16, 64)
    with torch.no_grad():
        y, yq = model(x), fresh(x)
    assert float(((y - yq) ** 2).mean() / (y**2).mean()) < 1e-3
    with pytest.raises(RuntimeError, match="Missing key"):
        load_into_model(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32), nn.Linear(32, 2)), dst)


@pytest.mark.cuda
def test_quantize_on_cuda_matches_cpu(tmp_path: Path, model_file: Path) -> None:
    cpu = quantize_file(model_file, tmp_path / "cpu.safetensors", CONFIG, device="cpu")
    gpu = quantize_file(model_file, tmp_path / "gpu.safetensors", CONFIG, device="cuda")
    assert gpu.summary.device.startswith("cuda")
    for a, b in zip(cpu.tensors, gpu.tensors, strict=True):
        if a.stats and b.stats:
            assert b.stats.mse == pytest.approx(a.stats.mse, rel=1e-3)
    da, db = read_artifact(tmp_path / "cpu.safetensors").dequantize(), \
        read_artifact(tmp_path / "gpu.safetensors").dequantize()
    for k in da:
        np.testing.assert_allclose(da[k], db[k], rtol=1e-3, atol=1e-3)


def test_calibrate_file(tmp_path: Path) -> None:
    from quantd.io import calibrate_file
    from quantd_client import ObserverSpec

    g = torch.Generator().manual_seed(5)
    acts = {"block.0.input": torch.randn(32, 16, generator=g) * 3, "block.1.input": torch.rand(8, 4, 10, generator=g)}
    p = tmp_path / "acts.safetensors"
    save_file(acts, str(p))
    resp = calibrate_file(p, ObserverSpec(dtype="int8", observer="minmax"), device="cpu")
    by_name = {layer.name: layer for layer in resp.layers}
    assert set(by_name) == set(acts)
    for name, x in acts.items():
        layer = by_name[name]
        lo, hi = float(x.min()), float(x.max())
        # the observed range, or that range widened to include 0 (as the qparams use it)
        assert layer.min in (pytest.approx(lo, rel=1e-6), pytest.approx(min(lo, 0.0), rel=1e-6))
        assert layer.max in (pytest.approx(hi, rel=1e-6), pytest.approx(max(hi, 0.0), rel=1e-6))
        assert layer.observer == "minmax"

    bad = tmp_path / "bad.safetensors"
    save_file({"ids": torch.arange(4)}, str(bad))
    with pytest.raises(MalformedInputError, match="'ids'"):
        calibrate_file(bad, ObserverSpec(), device="cpu")
    nan = tmp_path / "nan.safetensors"
    save_file({"a": torch.tensor([[1.0, float("nan")]])}, str(nan))
    with pytest.raises(NonFiniteError, match="'a'"):
        calibrate_file(nan, ObserverSpec(), device="cpu")


def test_calibration_samples_are_observed_first(tmp_path: Path, model_file: Path) -> None:
    from quantd_client import ObserverSpec

    calib = tmp_path / "acts.safetensors"
    save_file({"fc.in": torch.tensor([[-2.0, 0.5], [1.0, 6.0]])}, str(calib))
    config = QuantConfig(scheme=Scheme(dtype="int8", granularity="channel"),
                         activations=ObserverSpec(dtype="int8", symmetric=True))
    report = quantize_file(model_file, tmp_path / "out.safetensors", config, device="cpu", calibration=calib)
    (layer,) = report.activations or []
    assert (layer.min, layer.max, layer.num_samples) == (-2.0, 6.0, 2)
    assert read_artifact(tmp_path / "out.safetensors").metadata["activations"][0]["name"] == "fc.in"
    # a broken calibration file fails before any weight is touched: no artifact is left behind
    save_file({"fc.in": torch.tensor([[float("nan"), 1.0]])}, str(calib))
    with pytest.raises(NonFiniteError, match=r"fc\.in"):
        quantize_file(model_file, tmp_path / "bad.safetensors", config, device="cpu", calibration=calib)
    assert not (tmp_path / "bad.safetensors").exists() and not (tmp_path / "bad.safetensors.tmp").exists()


@pytest.mark.slow
def test_warm_up_leaves_nothing_to_compile_for_other_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the warm-up, weights of other shapes (square or not, of fewer or more than 4096 blocks) find their
    kernels built: nothing compiles again inside a job (Dynamo is told to fail on any recompile)."""
    import torch._dynamo

    from quantd.engine import kernels
    from quantd.io.pipeline import _measure, warm_up

    schemes = [Scheme(dtype="int4", symmetric=False, granularity="group", group_size=64, method="hqq"),
               Scheme(dtype="int8", symmetric=True, granularity="channel")]
    torch._dynamo.reset()  # the variants earlier tests built for their shapes do not count
    kernels.KERNELS.reset(available=True)
    try:
        assert warm_up(schemes) is not None
        monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
        g = torch.Generator().manual_seed(3)
        for shape in [(384, 384), (384, 1536), (64, 4096), (4608, 512)]:
            w = torch.randn(*shape, generator=g)
            for scheme in schemes:
                _measure(w, scheme, "w")
        assert kernels.KERNELS._broken is None, kernels.KERNELS._broken
    finally:
        kernels.KERNELS.reset()


def test_warm_up_builds_the_kernels_of_its_schemes(compiled: None) -> None:
    from quantd.engine import kernels
    from quantd.io.pipeline import warm_up

    kernels.KERNELS._warm.clear()  # what earlier tests warmed does not count
    took = warm_up([Scheme(dtype="int4", symmetric=False, granularity="group", group_size=128)])
    assert took is not None and took > 0
    warm = {key[0] for key in kernels.KERNELS._warm}
    # quantize (min-max in one kernel), stats (clipping reads the ranges), packing
    assert {"minmax", "range", "pack", "moments_codes", "outside"} <= warm, warm
    kernels.KERNELS.reset(available=False)
    assert warm_up() is None  # compiled kernels off: nothing to warm
