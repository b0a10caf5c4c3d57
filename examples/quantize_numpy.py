"""Quantize a NumPy array through a local server and look at the error.

    quantd serve &            # in another terminal
    python examples/quantize_numpy.py [URL]    # default: $QUANTD_URL, else http://127.0.0.1:8000
"""

import sys

import numpy as np

from quantd_client import Client, QuantConfig, Scheme

url = sys.argv[1] if len(sys.argv) > 1 else None  # None: the client reads QUANTD_URL
w = np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32)

with Client(url) as client:
    for dtype in ("int8", "int4", "nf4"):
        art = client.quantize(w, QuantConfig(scheme=Scheme(dtype=dtype, group_size=128)), name="w")
        w_hat = art.dequantize()["w"]
        sqnr = 10 * np.log10(np.mean(w**2) / np.mean((w - w_hat) ** 2))
        s = art.summary
        print(f"{dtype:5s} SQNR {sqnr:6.2f} dB  bits/weight {s.bits_per_weight if s else float('nan'):.2f}  "
              f"artifact {art.nbytes} bytes")
