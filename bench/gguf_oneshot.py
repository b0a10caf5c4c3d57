"""A one-shot GGUF run as a batch user meets it: ``quantd quantize model.gguf --gguf-mix MIX`` in a new process,
file to file, on the eager torch ops and on the compiled kernels (built on a cold kernel cache, and loaded
from the cache that run filled), against llama.cpp's ``llama_model_quantize`` (1 and N threads) on the same
file, for two model sizes written here with gguf-py (no download).

From the two sizes, each path's time is fitted as ``fixed + per-weight · weights`` (weights: those the mix
quantizes to ggml types), and the model size from which the compiled kernels repay their build is
``(fixed_compiled − fixed_eager) / (per-weight_eager − per-weight_compiled)``: on a cold and on a warm kernel
cache. That is what ``QUANTD_COMPILE=auto`` decides a one-shot GGUF run by
(``quantd.runtime.ONE_SHOT_GGUF_KERNEL_WEIGHTS_PER_THREAD``, or ``WARM_GGUF_KERNEL_WEIGHTS_PER_THREAD`` on a
cache ``quantd warm-up`` filled: the *auto, warmed cache* path). Writes ``bench/results/gguf_oneshot.json``.

    python bench/gguf_oneshot.py [--mix Q4_K_M] [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path += [str(HERE), str(HERE.parent / "tests")]

from common import log, machine_info, write_results  # noqa: E402
from gguf_vs_llamacpp import FILE_TYPES, write_model  # noqa: E402

# Two llama-architecture models: a TinyLlama-wide one of 8 blocks (about 0.5 billion weights) and one of 2
# blocks with a small vocabulary (about 0.1 billion).
SIZES = {"large": {"embd": 2048, "ff": 5632, "layers": 8, "vocab": 32000},
         "small": {"embd": 2048, "ff": 5632, "layers": 2, "vocab": 8000}}


def cli_run(src: Path, dst: Path, mix: str, threads: int, env: dict[str, str]) -> float:
    """``quantd quantize`` in a new process: wall seconds from its start to its exit."""
    cmd = [sys.executable, "-m", "quantd", "quantize", str(src), "--gguf-mix", mix, "-o", str(dst), "--json"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=3600,
                   env={**os.environ, "OMP_NUM_THREADS": str(threads), **env})
    return time.perf_counter() - t0


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """``(fixed s, s per weight)`` of the line through two ``(weights, seconds)`` points."""
    (w0, t0), (w1, t1) = sorted(points)
    per = (t1 - t0) / (w1 - w0)
    return t0 - per * w0, per


def break_even(eager: tuple[float, float], compiled: tuple[float, float]) -> float | None:
    """Weights from which the compiled path takes less time than the eager one; None when it never does."""
    gain = eager[1] - compiled[1]
    return None if gain <= 0 else max(0.0, (compiled[0] - eager[0]) / gain)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from _gguf_models import llama_quantize
    from quantd.io.outputs.gguf import ggml_weights
    from quantd_client import QuantConfig

    tmp = Path(tempfile.mkdtemp(prefix="quantd-gguf-oneshot-"))
    config = QuantConfig(output="gguf", gguf_mix=args.mix)  # type: ignore[arg-type]
    result: dict[str, Any] = {
        "machine": machine_info(), "mix": args.mix, "threads": args.threads, "repeats": args.repeats,
        "timing": f"eager, warm cache and auto: the median of {args.repeats} interleaved rounds; cold cache: one "
                  "run per model (each needs an empty cache), before the rounds",
        "models": [],
    }
    try:
        # ``quantd warm-up`` into a cache of its own, once: the auto path's runs on it take the compiled kernels
        # from the warm threshold (runtime.WARM_GGUF_KERNEL_WEIGHTS_PER_THREAD), as a batch user's after it.
        warmed = {"QUANTD_COMPILE": "auto", "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor-warmed")}
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "quantd", "warm-up"], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, timeout=3600, env={**os.environ, "OMP_NUM_THREADS": str(args.threads),
                                                                 **warmed})
        result["warm_up_s"] = time.perf_counter() - t0
        log(f"quantd warm-up: {result['warm_up_s']:.1f} s")
        for name, shape in SIZES.items():
            src = write_model(tmp / f"{name}-f32.gguf", **shape)
            row: dict[str, Any] = {"model": name, **shape, "bytes": src.stat().st_size,
                                   "ggml_weights": ggml_weights(src, config)}
            cache = tmp / f"inductor-{name}"
            paths = (("eager_s", {"QUANTD_COMPILE": "0"}),
                     ("compiled_cold_cache_s", {"QUANTD_COMPILE": "1", "TORCHINDUCTOR_CACHE_DIR": str(cache)}),
                     ("compiled_warm_cache_s", {"QUANTD_COMPILE": "1", "TORCHINDUCTOR_CACHE_DIR": str(cache)}),
                     ("auto_s", {"QUANTD_COMPILE": "auto", "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor-auto")}),
                     ("auto_warmed_cache_s", warmed))
            # The cold run first (it fills the cache the warm runs load), then the other paths in interleaved
            # rounds, so that a burst of load from other processes hits each of them alike.
            runs: dict[str, list[float]] = {key: [] for key, _ in paths}
            rounds = [paths[1:2]] + [[p for p in paths if p[0] != "compiled_cold_cache_s"]] * args.repeats
            for group in rounds:
                for key, env in group:
                    runs[key].append(cli_run(src, tmp / "out.gguf", args.mix, args.threads, env))
            for key, times in runs.items():
                row[key], row[key.replace("_s", "_runs_s")] = statistics.median(times), times
                log(f"{name}: {key} {row[key]:.1f} s ({', '.join(f'{t:.1f}' for t in times)})")
            for n in sorted({1, args.threads}):
                row[f"llama_cpp_{n}t_s"] = llama_quantize(src, tmp / "llama.gguf", FILE_TYPES[args.mix], nthread=n)
                log(f"{name}: llama.cpp {n} thread(s) {row[f'llama_cpp_{n}t_s']:.1f} s")
            result["models"].append(row)
            src.unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lines = {key: fit([(r["ggml_weights"], r[key]) for r in result["models"]])
             for key in ("eager_s", "compiled_cold_cache_s", "compiled_warm_cache_s")}
    result["fit"] = {k: {"fixed_s": a, "ns_per_weight": b * 1e9} for k, (a, b) in lines.items()}
    result["break_even_weights"] = {
        "cold_cache": break_even(lines["eager_s"], lines["compiled_cold_cache_s"]),
        "warm_cache": break_even(lines["eager_s"], lines["compiled_warm_cache_s"]),
    }
    from quantd.runtime import ONE_SHOT_GGUF_KERNEL_WEIGHTS_PER_THREAD, WARM_GGUF_KERNEL_WEIGHTS_PER_THREAD

    result["auto_threshold_weights"] = ONE_SHOT_GGUF_KERNEL_WEIGHTS_PER_THREAD * args.threads
    result["auto_warmed_threshold_weights"] = WARM_GGUF_KERNEL_WEIGHTS_PER_THREAD * args.threads
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mix", default="Q4_K_M", choices=list(FILE_TYPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each path but the cold one (median kept)")
    ap.add_argument("--out", default="gguf_oneshot.json")
    args = ap.parse_args(argv)
    log(f"wrote {write_results(args.out, run(args))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
