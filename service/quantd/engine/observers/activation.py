"""``ActivationObserver``: the range of a stream of activation batches, in bounded state."""

from __future__ import annotations

import torch

from quantd.engine.qparams import choose_qparams
from quantd.errors import ConfigError, MalformedInputError, NonFiniteError
from quantd_client import Scheme
from quantd_client._dtypes import dtype_info

from .base import CHUNK_ELEMENTS, observe_range

# Reservoir bounds: at most RESERVOIR_PER_CHANNEL samples per tensor/channel, RESERVOIR_TOTAL in all
# (but never fewer than RESERVOIR_MIN per channel).
RESERVOIR_PER_CHANNEL = 1 << 20
RESERVOIR_TOTAL = 1 << 22
RESERVOIR_MIN = 4096


class ActivationObserver:
    """Observes a stream of activation batches ``[N, ...]`` and gives their range and qparams.

    Granularity ``tensor`` (one range) or ``channel`` on ``axis`` (default ``scheme.axis``; −1 for the
    features of ``[N, ..., F]``). State is bounded whatever the stream length:

    - ``minmax``: running min/max per tensor/channel.
    - ``ema``: ``r ← (1 − m)·r + m·r_batch`` of the per-batch min and max (momentum ``m``, default
      0.01); the first batch initialises.
    - ``percentile``, ``meanstd``, ``mse``, ``entropy``: a uniform reservoir sample (Vitter's algorithm
      R, vectorised per batch) of at most ``RESERVOIR_PER_CHANNEL`` values per tensor/channel
      (``RESERVOIR_TOTAL`` over all channels); ``range()`` runs :func:`observe_range` on it. Exact
      while the stream fits in the reservoir, a uniform-sample estimate beyond.

    ``num_samples`` counts the rows (the leading dimension ``N``) seen.
    """

    def __init__(self, scheme: Scheme, *, name: str = "activation", axis: int | None = None,
                 reservoir_size: int | None = None, seed: int = 0) -> None:
        if scheme.granularity == "group":
            raise ConfigError("activation observers work per tensor or per channel", tensor=name,
                              field="granularity")
        if dtype_info(scheme.dtype).kind == "float":
            raise ConfigError(f"{scheme.dtype} is a plain cast and has no range to calibrate", tensor=name,
                              field="dtype")
        self.scheme = scheme
        self.name = name
        self.axis = scheme.axis if axis is None else axis
        self.num_samples = 0
        self.momentum = float(scheme.observer_args.get("momentum", 0.01))
        self._reservoir_size = reservoir_size
        self._seed = seed
        self._lo: torch.Tensor | None = None
        self._hi: torch.Tensor | None = None
        self._res: torch.Tensor | None = None
        self._seen = 0  # values per channel offered to the reservoir
        self._gen: torch.Generator | None = None

    @property
    def per_channel(self) -> bool:
        return self.scheme.granularity == "channel"

    def _rows(self, batch: torch.Tensor) -> torch.Tensor:
        """``[C, m]``: one row per tensor (C = 1) or channel."""
        if not self.per_channel:
            return batch.reshape(1, -1)
        if not -batch.dim() <= self.axis < batch.dim():
            raise ConfigError(f"axis {self.axis} is out of range for a batch of shape {tuple(batch.shape)}",
                              tensor=self.name, field="axis")
        axis = self.axis % batch.dim()
        v = batch.movedim(axis, 0).reshape(batch.shape[axis], -1)
        if self._lo is not None and self._lo.shape[0] != v.shape[0]:
            raise MalformedInputError(f"batch has {v.shape[0]} channels on axis {self.axis}, earlier batches "
                                      f"had {self._lo.shape[0]}", tensor=self.name)
        return v

    def update(self, batch: torch.Tensor) -> None:
        """Observe one batch ``[N, ...]`` (N rows)."""
        self._check_batch(batch)
        v = self._rows(batch.detach().float())
        lo, hi = torch.aminmax(v, dim=1)
        self._check_range(lo, hi)
        if self._lo is None or self._hi is None:
            self._lo, self._hi = lo, hi
        elif self.scheme.observer == "ema":
            self._lo = torch.lerp(self._lo, lo, self.momentum)
            self._hi = torch.lerp(self._hi, hi, self.momentum)
        else:
            self._lo, self._hi = torch.minimum(self._lo, lo), torch.maximum(self._hi, hi)
        if self.scheme.observer not in ("minmax", "ema"):
            self._sample(v)
        self.num_samples += int(batch.shape[0])

    def _check_batch(self, batch: torch.Tensor) -> None:
        if batch.dim() == 0 or batch.numel() == 0:
            raise MalformedInputError(f"activation batch must be [N, ...] and non-empty, got shape "
                                      f"{tuple(batch.shape)}", tensor=self.name)

    def _check_range(self, lo: torch.Tensor, hi: torch.Tensor) -> None:
        if not bool(torch.isfinite(lo).all() & torch.isfinite(hi).all()):
            raise NonFiniteError(f"activation {self.name!r} has NaN or Inf values", tensor=self.name)

    def update_samples(self, batch: torch.Tensor) -> None:
        """Observe the ``N`` samples of ``batch [N, ...]`` as ``N`` consecutive batches of one: the ``ema``
        average steps once per sample (the closed form of the ``N`` steps, weights in float64, equal to
        :meth:`update` called per sample to float32 rounding). The other observers do not depend on
        how the stream is batched, and see ``batch`` at once. A calibration file holds each layer's samples
        as one tensor: per sample is the only batching it tells."""
        self._check_batch(batch)
        n = batch.shape[0]
        # per channel, a sample's channels must lie on another axis than N's
        per_sample = not self.per_channel or (batch.dim() >= 2 and self.axis % batch.dim() != 0)
        if self.scheme.observer != "ema" or n == 1 or not per_sample:
            self.update(batch)
            return
        v = batch.detach().float()
        if self.per_channel:
            self._rows(batch[:1])  # the axis and channel count checks
            v = v.movedim(self.axis % v.dim(), 1).reshape(n, v.shape[self.axis], -1)
        else:
            v = v.reshape(n, 1, -1)
        lo_s, hi_s = torch.aminmax(v, dim=2)  # [N, C]
        self._check_range(lo_s, hi_s)
        steps = n - 1 if self._lo is None else n  # the first sample of a stream initialises
        keep = 1.0 - self.momentum  # r_k = keep^k·r_0 + Σ_j m·keep^(k−1−j)·x_j
        powers = torch.pow(torch.tensor(keep, dtype=torch.float64, device=v.device),
                           torch.arange(steps, -1, -1, dtype=torch.float64, device=v.device))  # keep^k … keep^0
        weights = (powers[1:] * self.momentum).unsqueeze(1)

        def average(prior: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
            return (powers[0] * prior.double() + (weights * xs.double()).sum(0)).float()

        if self._lo is None or self._hi is None:
            self._lo, self._hi = average(lo_s[0], lo_s[1:]), average(hi_s[0], hi_s[1:])
        else:
            self._lo, self._hi = average(self._lo, lo_s), average(self._hi, hi_s)
        self.num_samples += n

    def _capacity(self, channels: int) -> int:
        if self._reservoir_size is not None:
            return max(1, self._reservoir_size)
        return min(RESERVOIR_PER_CHANNEL, max(RESERVOIR_MIN, RESERVOIR_TOTAL // channels))

    def _sample(self, v: torch.Tensor) -> None:
        """Algorithm R over the columns of ``v[C, m]``: value number t (0-based) replaces slot
        ``j ~ U{0..t}`` when ``j < capacity``; within a batch the last writer of a slot wins."""
        channels, m = v.shape
        if self._res is None:
            self._res = torch.empty(channels, self._capacity(channels), dtype=torch.float32, device=v.device)
            self._gen = torch.Generator(device=v.device).manual_seed(self._seed)
        res = self._res
        cap = res.shape[1]
        take = min(max(cap - self._seen, 0), m)
        res[:, self._seen:self._seen + take] = v[:, :take]
        self._seen += take
        for c0 in range(take, m, CHUNK_ELEMENTS):
            rest = v[:, c0:c0 + CHUNK_ELEMENTS]
            n = rest.shape[1]
            t = torch.arange(self._seen, self._seen + n, device=v.device, dtype=torch.float64)
            u = torch.rand(n, generator=self._gen, device=v.device, dtype=torch.float64)
            j = (u * (t + 1)).floor_().long()
            keep = torch.nonzero(j < cap).squeeze(1)
            winner = torch.full((cap,), -1, dtype=torch.long, device=v.device)
            winner.scatter_reduce_(0, j[keep], keep, reduce="amax")
            slots = torch.nonzero(winner >= 0).squeeze(1)
            res[:, slots] = rest[:, winner[slots]]
            self._seen += n

    def range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lo, hi)`` float32: shape ``[]`` per tensor, ``[C]`` per channel."""
        if self._lo is None or self._hi is None:
            raise MalformedInputError("no activation batch observed yet", tensor=self.name)
        if self.scheme.observer in ("minmax", "ema") or self._res is None:
            lo, hi = self._lo, self._hi
        else:
            filled = min(self._seen, self._res.shape[1])
            lo, hi = observe_range(self._res[:, :filled], self.scheme, name=self.name)
        return (lo, hi) if self.per_channel else (lo.squeeze(0), hi.squeeze(0))

    def qparams(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(scale, zero_point)`` of :meth:`range` by ``choose_qparams`` (zero point None if symmetric)."""
        lo, hi = self.range()
        return choose_qparams(lo, hi, dtype=self.scheme.dtype, symmetric=self.scheme.symmetric,
                              scale_dtype=self.scheme.scale_dtype)

