"""The engine on a CUDA device: RTN against the same run's device-to-device copy of the same weight.

    python bench/gpu.py [--repeats 20] [--out gpu.json] [--breakdown] [--shapes 4096x4096] [--dtypes float32]

For a 4096×4096 and an 11008×4096 weight in float32 and bfloat16, and the schemes int8 per channel
(symmetric) and int4 g128 (affine), each of the engine's CUDA paths (``compiled``: the Triton kernels that
``torch.compile`` builds from the same fused functions as the CPU's; ``eager``: torch's own CUDA ops) is timed
for

- ``quantize``: ``quantize(x, scheme)``, the engine call (ranges, qparams, codes in device memory);
- ``quantize+pack+stats``: that, the artifact's packed tensors (``encode_quantized``) and the error statistics
  (``quantized_error_stats``): what a job does with a tensor besides reading and writing the file;

against ``dst.copy_(src)`` of the same weight. Bandwidth is counted in the fewest bytes each step must move
(the weight read once; codes, or packed codes, scales and zero points written once) and set against the
copy's (the weight read and written); the eager path, many times slower, gets a fifth of the loops. ``--breakdown`` also records, for the compiled path, each CUDA kernel's
share of the device time and the host's busiest functions (cProfile). Times are per call: CUDA events around loops of calls, median of
``repeats`` loops, with the host's per-call work (Python, guards, the host syncs of the NaN and scale checks)
included, as a job meets it; ``device_us`` is the CUDA kernels' own time per call (the profiler's sum), the
host left out. The inputs rotate among copies that together exceed the L2 cache, so no call reads a weight
the previous one left in cache. Skipped (with a message) without CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import log, machine_info, private_inductor_cache, write_results
from quantd.engine import kernels
from quantd.engine.primitives import quantize
from quantd.engine.stats import quantized_error_stats
from quantd.io.artifact import encode_quantized
from quantd_client import Scheme

SHAPES = ((4096, 4096), (11008, 4096))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SCHEMES: dict[str, dict[str, Any]] = {
    "int8_channel_sym": {"dtype": "int8", "granularity": "channel", "symmetric": True},
    "int4_g128_affine": {"dtype": "int4", "granularity": "group", "group_size": 128, "symmetric": False},
}
TARGETS = {"quantize": 0.70, "quantize+pack+stats": 0.40}


def _loop_us(fn: Callable[[int], object], calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the microseconds per call of ``calls`` calls ``fn(i)`` between two CUDA
    events (the device drained before each loop)."""
    per_call = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(i)
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1000.0 / calls)
    return statistics.median(per_call)


def _device_us(fn: Callable[[int], object], calls: int) -> float:
    """The CUDA kernels' own microseconds per call (the profiler's sum of their device time)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(i)
        torch.cuda.synchronize()
    total = sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages())
    return float(total) / calls


def _min_bytes(numel: int, in_bytes: int, scheme: dict[str, Any], *, packed: bool, rows: int) -> int:
    """The fewest bytes a step must move: the weight read once, the codes (one byte each, or packed at the
    dtype's bits) and the scales (float16) and zero points (int8) written once."""
    bits = 8 if scheme["dtype"] == "int8" else 4
    blocks = rows if scheme["granularity"] == "channel" else numel // scheme["group_size"]
    codes = numel * bits // 8 if packed else numel
    qparams = blocks * 2 + (0 if scheme.get("symmetric", True) else blocks)
    return numel * in_bytes + codes + qparams


def _kernel_table(fn: Callable[[int], object], calls: int) -> list[dict[str, Any]]:
    """The CUDA kernels of ``calls`` calls of ``fn``, busiest first: name, device µs and launches per call."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(i)
        torch.cuda.synchronize()
    rows = [{"kernel": e.key[:120], "device_us": float(getattr(e, "self_device_time_total", 0.0)) / calls,
             "launches": e.count / calls} for e in prof.key_averages()]
    return sorted((r for r in rows if r["device_us"] > 0), key=lambda r: -r["device_us"])[:10]


def _host_profile(fn: Callable[[int], object], calls: int) -> list[str]:
    """The host functions where ``calls`` calls of ``fn`` spend their time (cProfile, by own time, per call)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:15]  # type: ignore[attr-defined]
    return [f"{tt / calls * 1e6:8.1f} µs own {ct / calls * 1e6:8.1f} µs cumulative {nc / calls:6.1f}× "
            f"{Path(file).name}:{line} {func}" for (file, line, func), (_, nc, tt, ct, _) in rows]


def run_case(shape: tuple[int, int], dtype: torch.dtype, repeats: int, *, breakdown: bool = False
             ) -> dict[str, Any]:
    rows, cols = shape
    numel = rows * cols
    in_bytes = torch.finfo(dtype).bits // 8
    weight_bytes = numel * in_bytes
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    copies = max(2, -(-4 * l2 // weight_bytes))  # rotate through > 4 × L2 of inputs
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = [(torch.randn(shape, generator=g, device="cuda") * 0.02).to(dtype) for _ in range(copies)]
    dst = torch.empty_like(xs[0])
    calls = max(copies, 10)
    copy_us = _loop_us(lambda i: dst.copy_(xs[i % copies]), calls, repeats)
    copy_bw = 2 * weight_bytes / copy_us / 1e3  # GB/s
    out: dict[str, Any] = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "input_copies": copies,
                           "copy_us": copy_us, "copy_GBps": copy_bw, "schemes": {}}
    log(f"{shape} {out['dtype']}: copy {copy_us:.1f} µs ({copy_bw:.0f} GB/s)")
    for sname, spec in SCHEMES.items():
        scheme = Scheme.model_validate(spec)
        steps: dict[str, Callable[[int], object]] = {
            "quantize": lambda i, s=scheme: quantize(xs[i % copies], s),
            "quantize+pack+stats": lambda i, s=scheme: _job_step(xs[i % copies], s),
        }
        per_path: dict[str, Any] = {}
        for path in ("compiled", "eager"):
            kernels.KERNELS.reset(available=path == "compiled")
            if path == "compiled" and not kernels.KERNELS.available_cuda():
                per_path[path] = {"skipped": "no compiled CUDA kernels in this torch (kernels.cuda_options)"}
                continue
            entry: dict[str, Any] = {}
            for step, fn in steps.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(0)  # the first call: compiles (or loads) the kernels on the compiled path
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                wall = _loop_us(fn, calls, repeats if path == "compiled" else max(2, repeats // 5))
                peak = torch.cuda.max_memory_allocated() - before
                device = _device_us(fn, calls)
                need = _min_bytes(numel, in_bytes, spec, packed=step != "quantize", rows=rows)
                frac = need / wall / 1e3 / copy_bw
                entry[step] = {
                    "first_call_s": first, "wall_us": wall, "device_us": device, "min_bytes": need,
                    "GBps": need / wall / 1e3, "copy_bandwidth_fraction": frac,
                    "device_copy_bandwidth_fraction": need / device / 1e3 / copy_bw,
                    "target": TARGETS[step], "meets_target": frac >= TARGETS[step],
                    "peak_extra_gpu_bytes_per_call": peak,
                }
                if breakdown and path == "compiled":
                    entry[step]["kernels"] = _kernel_table(fn, calls)
                    entry[step]["host"] = _host_profile(fn, calls)
                    log("    " + "\n    ".join(f"{k['device_us']:8.1f} µs {k['launches']:.0f}× {k['kernel']}"
                                               for k in entry[step]["kernels"]))
                    log("    " + "\n    ".join(entry[step]["host"]))
                log(f"  {sname} {path} {step}: {wall:.1f} µs/call ({device:.1f} µs on the device), "
                    f"{frac:.2f} of the copy's bandwidth (device time {entry[step]['device_copy_bandwidth_fraction']:.2f})"
                    f"; first call {first:.2f} s")
            if kernels.KERNELS.failed_cuda:
                entry["kernels_run_eager"] = dict(kernels.KERNELS.failed_cuda)
            per_path[path] = entry
        out["schemes"][sname] = per_path
    kernels.KERNELS.reset()
    return out


def _job_step(x: torch.Tensor, scheme: Scheme) -> object:
    qt = quantize(x, scheme)
    return encode_quantized(qt, "w"), quantized_error_stats(x, qt)


def main(argv: list[str] | None = None) -> int:
    private_inductor_cache()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=20, help="timed loops per step (median)")
    ap.add_argument("--out", default="gpu.json", help="file name under bench/results/")
    ap.add_argument("--breakdown", action="store_true", help="per-kernel device times and a host profile too")
    ap.add_argument("--shapes", default=",".join(f"{r}x{c}" for r, c in SHAPES), help="e.g. 4096x4096,11008x4096")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="e.g. float32,bfloat16")
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to measure")
        return 0
    t0 = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    payload: dict[str, Any] = {
        "benchmark": "gpu", "machine": machine_info(),
        "device": {"name": props.name, "memory_bytes": props.total_memory,
                   "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda,
                   "triton": _version("triton"), "compiled_kernels": kernels.cuda_options() is not None},
        "targets": TARGETS, "cases": [],
    }
    for shape in shapes:
        for dtype in dtypes:
            payload["cases"].append(run_case((shape[0], shape[1]), dtype, args.repeats, breakdown=args.breakdown))
            torch.cuda.empty_cache()
    payload["elapsed_s"] = time.perf_counter() - t0
    log(f"wrote {write_results(args.out, payload)} in {payload['elapsed_s']:.0f} s")
    return 0


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
