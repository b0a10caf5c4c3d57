"""Observer cost and fidelity: quantize a 4096×4096 f32 weight with each observer.

For every observer (minmax, percentile, meanstd, ema, mse, entropy) × scheme (int8 per-channel,
int4 g128, symmetric) this times ``quantize`` (best of N runs after one warm-up, in one process),
gives the ratio to minmax's time, and the MSE relative to minmax's on a Gaussian weight in which 1 %
of the elements is scaled ×10. Prints a table and writes ``bench/results/observers.json`` (with the
machine facts and ``/proc/loadavg`` before and after: the machine is shared, timings are noisy).

    python bench/observers.py [--size 4096] [--repeats 3] [--threads 1] [--observers mse,entropy]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import log, machine_info, outlier_weight, private_inductor_cache, write_results

from quantd.engine.primitives import dequantize, quantize
from quantd_client import Scheme

OBSERVERS = ("minmax", "percentile", "meanstd", "ema", "mse", "entropy")
SCHEMES = {
    "int8_channel": Scheme(dtype="int8", symmetric=True, granularity="channel"),
    "int4_g128": Scheme(dtype="int4", symmetric=True, granularity="group", group_size=128),
}


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


def best_of(fn: Any, repeats: int) -> tuple[float, Any]:
    result = fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def run(size: int, repeats: int, observers: list[str]) -> dict[str, Any]:
    w = outlier_weight(size, size, seed=0)
    rows: list[dict[str, Any]] = []
    for scheme_name, base in SCHEMES.items():
        base_t: float | None = None
        base_mse: float | None = None
        for observer in ["minmax", *[o for o in observers if o != "minmax"]]:
            scheme = base.model_copy(update={"observer": observer})
            t, qt = best_of(lambda s=scheme: quantize(w, s, name="w"), repeats)
            mse = float((dequantize(qt) - w).double().square().mean())
            if observer == "minmax":
                base_t, base_mse = t, mse
            assert base_t is not None and base_mse is not None
            row = {"scheme": scheme_name, "observer": observer, "seconds": t, "ratio_to_minmax": t / base_t,
                   "mse": mse, "mse_rel_minmax": mse / base_mse, "loadavg": loadavg()}
            rows.append(row)
            log(f"{scheme_name:13s} {observer:10s} {t:8.3f} s  x{t / base_t:6.1f}  mse/minmax {mse / base_mse:.4f}"
                f"  load {row['loadavg']}")
    return {"rows": rows}


def main() -> None:
    private_inductor_cache()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--observers", default=",".join(OBSERVERS))
    p.add_argument("--out", default="observers.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    load_before = loadavg()
    result = run(a.size, a.repeats, [o for o in a.observers.split(",") if o])
    payload = {"machine": machine_info(), "size": [a.size, a.size], "repeats": a.repeats, "threads": a.threads,
               "data": "N(0, 0.02) weight, 1 % of elements x10", "timing": "best of repeats after one warm-up",
               "loadavg_before": load_before, "loadavg_after": loadavg(), **result}
    path = write_results(a.out, payload)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
