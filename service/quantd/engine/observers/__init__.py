"""Range observers: the ``(lo, hi)`` a block of weights or activations is quantized to.

One module per kind of observer, each registering its names in :data:`OBSERVERS` (``base``):
:mod:`.ranges` (``minmax``, ``ema``, ``percentile``, ``meanstd``), :mod:`.mse` (the clip-ratio search),
:mod:`.entropy` (KL-divergence calibration) and :mod:`.activation` (streams of activation batches);
the compiled twin of the mse search's inner loop is ``engine.kernels.mse``.

``observe_range(blocks, scheme)`` works on the block view ``[B, K]`` (one range per block row) and is
vectorised over blocks; ``quantize`` calls it for the range. The searches (``mse``, ``entropy``) are
vectorised over their candidates too and chunked so their extra memory stays bounded
(``CHUNK_ELEMENTS`` float32 elements per temporary, a few temporaries alive at once: ≤ ~64 MB).

Observers (``scheme.observer``, arguments in ``scheme.observer_args``):

- ``minmax``: ``lo = min(x)``, ``hi = max(x)`` per block.
- ``percentile`` (``percentile`` = p, default 99.99): symmetric → ``hi = Q_p(|x|)``, ``lo = −hi``;
  affine → ``lo = Q_{100−p}(x)``, ``hi = Q_p(x)``. ``Q`` is ``torch.quantile``'s linear interpolation,
  computed exactly from the needed tail only (``topk``/``kthvalue``), without its 16M-element limit.
- ``meanstd`` (``k``, default 3): ``mean ± k·std`` (population std), clipped to ``[min, max]``.
- ``ema``: on one weight tensor there is nothing to average over, so it equals ``minmax``; its use is
  streaming activations (:class:`ActivationObserver`).
- ``mse`` (``grid`` = G, default 100; ``min_ratio``, default 0.2; ``norm`` = n, default 2): clip ratios
  ``r ∈ linspace(min_ratio, 1, G)``; candidate range ``(r·lo, r·hi)`` (affine) or ``±r·absmax``
  (symmetric, nf4, fp8); pick per block the ``r`` minimising ``Σ|x − x̂_r|ⁿ`` where ``x̂_r`` is the
  fake quantization with that range. ``r = 1`` (min-max) is always a candidate, so the result is never
  worse than min-max. Large grids are searched coarse to fine (see :func:`mse_search_indices`).
- ``entropy`` (``bins``, default 2048; ``quant_bins``): the KL-divergence calibration of TensorRT /
  ONNX Runtime, see :func:`entropy_range`.
"""

from __future__ import annotations

from . import entropy, mse, ranges
from .activation import ActivationObserver
from .base import CHUNK_ELEMENTS, OBSERVERS, ObserverFn, observe_range, register
from .entropy import entropy_range
from .mse import MSE_CHUNK_ELEMENTS, mse_chunk_plan, mse_search_indices
from .ranges import percentile_range

__all__ = [
    "CHUNK_ELEMENTS",
    "MSE_CHUNK_ELEMENTS",
    "OBSERVERS",
    "ActivationObserver",
    "ObserverFn",
    "entropy",
    "entropy_range",
    "mse",
    "mse_chunk_plan",
    "mse_search_indices",
    "observe_range",
    "percentile_range",
    "ranges",
    "register",
]
