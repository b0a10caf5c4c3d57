from __future__ import annotations

import pydantic
import pytest
import torch

from quantd.engine.calibration import calibrate_layers
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


def test_group_granularity_is_refused() -> None:
    # activation calibration is per tensor or per channel: the wire schema refuses "group"
    with pytest.raises(pydantic.ValidationError, match="granularity"):
        ObserverSpec.model_validate({"granularity": "group"})
