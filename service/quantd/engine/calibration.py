"""Static activation calibration: one streaming observer per layer, fed batches of samples.

``calibrate_layers`` takes ``(layer name, batch [N, ...])`` pairs in any order (a layer may come in
several batches) and returns, per layer in first-seen order, the observed range and the qparams
(``choose_qparams`` of that range) for the ``ObserverSpec``'s dtype. The ``ema`` observer's moving average
steps once per sample (each row of ``N``), as if the samples had come one forward pass at a time.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from quantd.engine.observers import ActivationObserver
from quantd_client import LayerCalibration, ObserverSpec

__all__ = ["calibrate_layers"]


def _values(t: torch.Tensor) -> float | list[float]:
    return float(t) if t.dim() == 0 else [float(v) for v in t.tolist()]


def _ints(t: torch.Tensor | None, like: torch.Tensor) -> int | list[int]:
    if t is None:
        return 0 if like.dim() == 0 else [0] * like.numel()
    return int(t) if t.dim() == 0 else [int(v) for v in t.tolist()]


def calibrate_layers(samples: Iterable[tuple[str, torch.Tensor]], spec: ObserverSpec) -> list[LayerCalibration]:
    """Per layer: ``min``, ``max`` (the observed range), ``scale``, ``zero_point`` (0 when symmetric),
    ``observer`` and ``num_samples`` (rows seen). Per channel (``spec.granularity == "channel"``, on
    ``spec.axis``) the values are lists, one per channel; per tensor they are numbers."""
    scheme = spec.as_scheme()
    observers: dict[str, ActivationObserver] = {}
    for name, batch in samples:
        obs = observers.get(name)
        if obs is None:
            obs = observers[name] = ActivationObserver(scheme, name=name, axis=spec.axis)
        obs.update_samples(batch)  # ema: one step per sample
    layers = []
    for name, obs in observers.items():
        lo, hi = obs.range()
        scale, zp = obs.qparams()
        layers.append(LayerCalibration(name=name, min=_values(lo), max=_values(hi), scale=_values(scale.float()),
                                       zero_point=_ints(zp, scale), observer=scheme.observer,
                                       num_samples=obs.num_samples))
    return layers
