from __future__ import annotations

import pydantic
import pytest
import torch

from quantd.engine.calibration import calibrate_layers
from quantd.engine.observers import ActivationObserver
from quantd.errors import MalformedInputError
from quantd_client import ObserverSpec


def _batches() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("fc1", torch.randn(8, 16, generator=g)), ("fc2", torch.rand(4, 3, 16, generator=g) * 6),
            ("fc1", torch.randn(5, 16, generator=g) * 2)]


def test_minmax_affine_int8_per_tensor_matches_reference() -> None:
    batches = _batches()
    layers = calibrate_layers(batches, ObserverSpec(dtype="int8", symmetric=False, observer="minmax"))
    assert [c.name for c in layers] == ["fc1", "fc2"]
    fc1 = torch.cat([batches[0][1], batches[2][1]])
    c = layers[0]
    assert c.num_samples == 13 and c.observer == "minmax"
    assert c.min == pytest.approx(float(fc1.min())) and c.max == pytest.approx(float(fc1.max()))
    ref_scale = (float(fc1.max()) - float(fc1.min())) / 255
    assert isinstance(c.scale, float) and c.scale == pytest.approx(ref_scale, rel=1e-3)
    assert c.zero_point == round(-128 - float(fc1.min()) / c.scale)
    fc2 = layers[1]  # all positive: the range is widened to include 0, zero point at qmin
    assert fc2.num_samples == 4 and fc2.zero_point == -128 and isinstance(fc2.min, float) and fc2.min > 0


def test_symmetric_per_channel_lists() -> None:
    batches = [("x", torch.randn(10, 4) * torch.tensor([1.0, 2.0, 3.0, 4.0]))]
    (c,) = calibrate_layers(batches, ObserverSpec(dtype="int8", symmetric=True, granularity="channel", axis=-1))
    assert isinstance(c.scale, list) and len(c.scale) == 4 and c.zero_point == [0, 0, 0, 0]
    amax = batches[0][1].abs().amax(0)
    for s, a in zip(c.scale, amax.tolist(), strict=True):
        assert s == pytest.approx(a / 127.5, rel=1e-3)


def test_percentile_observer_clips_a_spike() -> None:
    x = torch.randn(1000, 8, generator=torch.Generator().manual_seed(1))
    x[0, 0] = 1000.0
    (c,) = calibrate_layers([("a", x)], ObserverSpec(observer="percentile", observer_args={"percentile": 99.9}))
    assert isinstance(c.max, float) and c.max < 10.0


@pytest.mark.parametrize("granularity,axis", [("tensor", 0), ("channel", -1), ("channel", 1)])
def test_ema_steps_once_per_sample(granularity: str, axis: int) -> None:
    # a calibration file holds each layer's N samples as one tensor: the average steps once per sample
    g = torch.Generator().manual_seed(3)
    chunks = [torch.randn(7, 5, 6, generator=g) * (1 + i) for i in range(2)]  # the layer's samples, in 2 tensors
    spec = ObserverSpec(dtype="int8", symmetric=False, observer="ema", granularity=granularity, axis=axis,
                        observer_args={"momentum": 0.3})
    (c,) = calibrate_layers([("a", t) for t in chunks], spec)
    scheme = spec.as_scheme()
    ref = ActivationObserver(scheme, name="a", axis=axis)
    for t in chunks:
        for row in t:  # sample by sample: the moving average's definition
            ref.update(row.unsqueeze(0))
    lo, hi = ref.range()
    assert c.num_samples == ref.num_samples == 14
    torch.testing.assert_close(torch.tensor(c.min), lo, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.tensor(c.max), hi, rtol=1e-6, atol=1e-6)
    moved = {m: calibrate_layers([("a", chunks[0])], spec.model_copy(update={"observer_args": {"momentum": m}}))[0]
             for m in (0.01, 0.5)}
    assert moved[0.01].max != moved[0.5].max


def test_ema_steps_per_sample_of_a_1d_layer_and_after_a_prior_state() -> None:
    # [N] samples (one value each) went to update(): one step for the whole tensor
    g = torch.Generator().manual_seed(5)
    first, second = torch.randn(9, generator=g), torch.randn(6, 3, generator=g) * 4
    spec = ObserverSpec(observer="ema", observer_args={"momentum": 0.25})
    (c,) = calibrate_layers([("a", first), ("a", second)], spec)
    ref = ActivationObserver(spec.as_scheme(), name="a")
    for t in (first, second):
        for row in t:
            ref.update(row.reshape(1, -1))
    lo, hi = ref.range()
    assert c.num_samples == 15
    torch.testing.assert_close(torch.tensor(c.min), lo, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.tensor(c.max), hi, rtol=1e-6, atol=1e-6)
    obs = ActivationObserver(spec.as_scheme(), name="a")
    with pytest.raises(MalformedInputError, match="non-empty"):
        obs.update_samples(torch.empty(4, 0))


def test_the_default_observer_is_int8_affine_per_tensor() -> None:
    # activations default to int8 per tensor, not to a weight Scheme's default (int4)
    for spec in (ObserverSpec(), ObserverSpec(observer="ema"), ObserverSpec(symmetric=True)):
        scheme = spec.as_scheme()
        assert (scheme.dtype, scheme.granularity) == ("int8", "tensor") and scheme.symmetric == spec.symmetric
    for dtype, symmetric in (("fp8_e4m3", True), ("nf4", True), ("int8", False), ("uint8", False)):
        spec = ObserverSpec(dtype=dtype)  # symmetric resolved per dtype, and so sent: it survives the wire
        again = ObserverSpec.model_validate_json(spec.model_dump_json())
        assert spec.symmetric == again.symmetric == again.as_scheme().symmetric == symmetric
    x = torch.linspace(-1.0, 3.0, 64).reshape(4, 16)
    (c,) = calibrate_layers([("a", x)], ObserverSpec())
    assert c.scale == pytest.approx(4.0 / 255, rel=1e-3) and c.zero_point == round(-128 + 1.0 / c.scale)


def test_group_granularity_is_refused() -> None:
    # activation calibration is per tensor or per channel: the wire schema refuses "group"
    with pytest.raises(pydantic.ValidationError, match="granularity"):
        ObserverSpec.model_validate({"granularity": "group"})
