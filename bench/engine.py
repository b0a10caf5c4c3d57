"""Engine throughput: GB/s of input quantized, against a same-run ``dst.copy_(src)`` of the same tensor.

    python bench/engine.py [--size 4096] [--repeats 7] [--eager] [--out bench/results/engine.json]

For a ``size × size`` weight in float32 and bfloat16, each scheme is timed (alternating with a copy of
the same tensor, whose best time is that scheme's baseline) as the best of ``repeats``
runs (after one warm-up), with ``torch.set_num_threads`` at its default and, for comparison, at 1.
Also times the naive unchunked chain (abs → amax → div → round → clamp → to) for int8 per-channel,
and the ``mse`` observer against ``minmax`` for the :data:`OBSERVED` schemes (int4 g128 and g64, nf4 g64,
fp8 e4m3 per channel; the two timed in alternation too). By default the engine uses its compiled CPU
kernels (the first call of each scheme, which compiles, is recorded apart as ``first_call_s``);
``--eager`` turns them off, to compare with the eager path. A benchmark, not a test: numbers depend on the machine
and on what else runs on it (the load average is recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py, also when imported

from common import machine_info, private_inductor_cache
from quantd.engine import kernels
from quantd.engine.primitives import quantize
from quantd_client import Scheme

SCHEMES: dict[str, dict[str, Any]] = {
    "int8_channel_sym": {"dtype": "int8", "granularity": "channel", "symmetric": True},
    "int4_g128_affine": {"dtype": "int4", "granularity": "group", "group_size": 128, "symmetric": False},
    "int4_g64_sym": {"dtype": "int4", "granularity": "group", "group_size": 64, "symmetric": True},
    "nf4_g64": {"dtype": "nf4", "granularity": "group", "group_size": 64},
    "fp8_e4m3_channel": {"dtype": "fp8_e4m3", "granularity": "channel"},
}


# The schemes whose mse observer is timed against min-max (the target: at most 10x).
OBSERVED: dict[str, dict[str, Any]] = {
    "int4_g128": {"dtype": "int4", "granularity": "group", "group_size": 128},
    "int4_g64": {"dtype": "int4", "granularity": "group", "group_size": 64},
    "nf4_g64": {"dtype": "nf4", "granularity": "group", "group_size": 64},
    "fp8_e4m3_channel": {"dtype": "fp8_e4m3", "granularity": "channel"},
}


def paired_times(a: Callable[[], object], b: Callable[[], object], repeats: int) -> tuple[list[float], list[float]]:
    """Times of ``a`` and ``b`` (a copy and a scheme, or min-max and mse), timed in alternation after one
    untimed call each: a burst of load from other processes hits both alike, so their ratio is steadier
    than that of two separate series."""
    a(), b()
    times_a, times_b = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        t2 = time.perf_counter()
        times_a.append(t1 - t0)
        times_b.append(t2 - t1)
    return times_a, times_b


def naive_int8_channel(x: torch.Tensor) -> torch.Tensor:
    scale = (x.float().abs().amax(dim=1, keepdim=True) / 127.5).clamp(min=1e-12)
    return (x.float() / scale).round().clamp(-128, 127).to(torch.int8)


def run(size: int, repeats: int, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    out: dict[str, Any] = {"threads": threads}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(dtype)
        gb = x.numel() * x.element_size() / 1e9
        dst = torch.empty_like(x)
        def copy(x: torch.Tensor = x, dst: torch.Tensor = dst) -> object:
            return dst.copy_(x)

        row: dict[str, Any] = {"input_gb": gb}
        copies = []
        fns: dict[str, Callable[[], object]] = {
            key: (lambda x=x, scheme=Scheme.model_validate(spec): quantize(x, scheme)) for key, spec in SCHEMES.items()}
        fns["naive_int8_channel_chain"] = lambda x=x: naive_int8_channel(x)
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()  # the first call compiles the scheme's kernels (when compiled)
            first = time.perf_counter() - t0
            copy_times, fn_times = paired_times(copy, fn, repeats)
            copy_s, s = min(copy_times), min(fn_times)
            copies.append(copy_s)
            # A copy's speed can vary within a run on a shared machine: the fraction is best against
            # best, and also given median against median.
            copy_med, fn_med = statistics.median(copy_times), statistics.median(fn_times)
            row[key] = {"s": s, "gbps": gb / s, "fraction_of_copy": copy_s / s, "paired_copy_s": copy_s,
                        "paired_copy_median_s": copy_med, "median_s": fn_med,
                        "fraction_of_median_copy": copy_med / fn_med, "first_call_s": first}
        row["copy"] = {"s": min(copies), "gbps": gb / min(copies)}
        out[str(dtype).removeprefix("torch.")] = row
    x = torch.randn(size, size, generator=torch.Generator().manual_seed(1))
    for key, spec in OBSERVED.items():
        minmax, mse = (Scheme(**spec, observer=o) for o in ("minmax", "mse"))
        # In alternation, like the copies above: a burst of load hits both, and the ratio is steadier.
        t_minmax, t_mse = paired_times(lambda s=minmax: quantize(x, s), lambda s=mse: quantize(x, s),
                                       max(3, repeats // 2))
        out[f"observer_{key}_float32"] = {
            "minmax": {"s": min(t_minmax), "median_s": statistics.median(t_minmax)},
            "mse": {"s": min(t_mse), "median_s": statistics.median(t_mse)},
            "mse_over_minmax": min(t_mse) / min(t_minmax),
            "mse_over_minmax_medians": statistics.median(t_mse) / statistics.median(t_minmax),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "engine.json")
    p.add_argument("--eager", action="store_true", help="turn the compiled kernels off")
    args = p.parse_args()
    inductor_cache = private_inductor_cache()
    if args.eager:
        kernels.KERNELS.reset(available=False)
    default_threads = torch.get_num_threads()
    result: dict[str, Any] = {
        "machine": {**machine_info(), "loadavg_before": os.getloadavg()},
        "kernels": "compiled" if kernels.KERNELS.available() else "eager",
        "inductor_cache": inductor_cache,
        "shape": [args.size, args.size],
        "runs": [run(args.size, args.repeats, default_threads)],
    }
    if default_threads != 1:
        result["runs"].append(run(args.size, args.repeats, 1))
    torch.set_num_threads(default_threads)
    result["machine"]["loadavg_after"] = os.getloadavg()
    result["kernels_fell_back"] = kernels.KERNELS._broken  # None: every compiled call worked
    print(f"kernels: {result['kernels']}")
    for r in result["runs"]:
        print(f"threads={r['threads']}")
        for dt in ("float32", "bfloat16"):
            row = r[dt]
            print(f"  {dt}: copy {row['copy']['gbps']:.2f} GB/s")
            for key in [*SCHEMES, "naive_int8_channel_chain"]:
                v = row[key]
                print(f"    {key:26s} {v['gbps']:7.2f} GB/s  {100 * v['fraction_of_copy']:5.1f}% of copy "
                      f"(copy best {v['paired_copy_s'] * 1e3:.2f} ms; medians: {100 * v['fraction_of_median_copy']:5.1f}%, "
                      f"copy {v['paired_copy_median_s'] * 1e3:.2f} ms)")
        for key in OBSERVED:
            o = r[f"observer_{key}_float32"]
            print(f"  observer {key}: minmax {o['minmax']['s'] * 1e3:.1f} ms, mse {o['mse']['s'] * 1e3:.1f} ms "
                  f"({o['mse_over_minmax']:.1f}x; medians {o['mse_over_minmax_medians']:.1f}x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
