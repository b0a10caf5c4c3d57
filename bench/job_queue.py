"""The job queue's own overhead: jobs per minute and submit→succeeded latency (p50/p95) with 1, 2 and 4
workers, SQLite against PostgreSQL, in one run.

Each cell runs the job layer in this process (``JobService`` with N embedded CPU workers, files on local disk
for both job stores, so that only the store differs) and submits ``--jobs`` small models (4 float32 tensors
of 64×64) at once; every job is followed through ``events`` as an SSE client would be, and its latency is
from just before its submit to the arrival of its ``succeeded`` event. Two pipelines: ``copy`` (the input
copied as the artifact, with four progress events: the queue's own cost, i.e. the durable insert, the claim,
progress writes, the late acknowledgement and waking the followers) and ``real`` (quantd's int8 pipeline;
its time alone on the model is measured in the same run as ``quantize_ms``). PostgreSQL is a throwaway local
cluster (Debian's binaries, fsync on), on the same machine.

    python bench/job_queue.py        # writes bench/results/queue.json
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

# (Not bench/queue.py: a script's directory leads sys.path, and that name would shadow the standard library's
# ``queue`` for every benchmark here.)
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests" / "jobs" / "backends"))  # its PostgreSQL

from servers import Unavailable, postgres

from common import log, machine_info, private_inductor_cache, write_results
from quantd.jobs import JobsConfig, JobService, StoredUpload
from quantd.jobs.storage import sha256_file
from quantd_client import Progress, QuantConfig, Report, Scheme, Summary

CONFIG = QuantConfig(scheme=Scheme(dtype="int8", granularity="channel", symmetric=True))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def make_model(path: Path) -> int:
    g = torch.Generator().manual_seed(0)
    save_file({f"layer.{i}.weight": torch.randn(64, 64, generator=g) for i in range(4)}, str(path))
    return 4


def copy_pipeline(src: Path, dst: Path, config: QuantConfig, *, device: str, filename: str | None = None,
                  job_id: str | None = None, on_progress: Any = None, should_cancel: Any = None) -> Report:
    """The queue alone: the input copied as the artifact, one progress event a tensor, no computation."""
    shutil.copyfile(src, dst)
    size = Path(src).stat().st_size
    for i in range(1, 5):
        if on_progress is not None:
            on_progress(Progress(tensors_done=i, tensors_total=4, bytes_done=size * i // 4, bytes_total=size,
                                 fraction=i / 4))
    summary = Summary(tensors_quantized=0, tensors_skipped=4, input_bytes=size, output_bytes=size,
                      compression_ratio=1.0, bits_per_weight=32.0, mean_sqnr_db=None, min_sqnr_db=None,
                      worst_tensor=None, elapsed_s=0.0, device=device)
    return Report(job_id=job_id, config=config, summary=summary, tensors=[])


def quantize_ms(model: Path, tmp: Path, repeats: int = 20) -> float:
    from quantd.io.pipeline import quantize_file

    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        quantize_file(model, tmp / "out.safetensors", CONFIG, device="cpu")
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1000


async def run_cell(model: Path, tensors: int, data_dir: Path, workers: int, jobs: int,
                   database_url: str | None, pipeline: str) -> dict[str, Any]:
    svc = JobService(JobsConfig(data_dir=data_dir, workers=workers, device="cpu", database_url=database_url,
                                quantize_during_upload=False),
                     quantize_fn=copy_pipeline if pipeline == "copy" else None)
    await svc.start()
    try:
        uploads = []
        for _ in range(jobs):
            dst = svc.new_upload_path(".safetensors")
            shutil.copyfile(model, dst)
            uploads.append(StoredUpload(path=dst, filename="m.safetensors", bytes=dst.stat().st_size,
                                        sha256=sha256_file(dst), format="safetensors", tensors=tensors))

        async def one(upload: StoredUpload) -> float:
            t0 = time.perf_counter()
            job = await svc.submit(tenant="bench", upload=upload, config=CONFIG)
            last = None
            async for name, _ in svc.events("bench", job.id):
                last = name
            if last != "succeeded":
                raise RuntimeError(f"job {job.id} ended {last}")
            return time.perf_counter() - t0

        t0 = time.perf_counter()
        latencies = await asyncio.gather(*(one(u) for u in uploads))
        wall = time.perf_counter() - t0
        recs = [r for r in svc.store.list_jobs("bench", status=None, limit=jobs + 1, after=None)]
        assert len(recs) == jobs and all(r.status == "succeeded" and r.attempts == 1 for r in recs)
    finally:
        await svc.stop()
    return {"pipeline": pipeline, "workers": workers, "jobs": jobs, "wall_s": round(wall, 3),
            "jobs_per_min": round(jobs / wall * 60, 1),
            "p50_ms": round(percentile(latencies, 0.5) * 1000, 1),
            "p95_ms": round(percentile(latencies, 0.95) * 1000, 1),
            "max_ms": round(max(latencies) * 1000, 1)}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="quantd-bench-queue-"))
    try:
        model = root / "model.safetensors"
        tensors = make_model(model)
        await asyncio.to_thread(quantize_ms, model, root, 3)  # untimed: the compiled kernels built first
        results: dict[str, list[dict[str, Any]]] = {"sqlite": [], "postgresql": []}
        skipped: dict[str, str] = {}
        try:
            pg_cm = postgres(fsync=True)
            pg = pg_cm.__enter__()
        except Unavailable as e:
            pg_cm, pg = None, None
            skipped["postgresql"] = str(e)
            log(f"PostgreSQL unavailable: {e}")
        try:
            cells = [(p, w, b) for p in args.pipelines for w in args.workers for b in ("sqlite", "postgresql")
                     if b == "sqlite" or pg is not None]
            for rnd in range(args.rounds):  # rounds interleave the cells: load bursts hit them alike
                for pipeline, workers, backend in cells:
                    url = pg.create_database(f"b_{uuid.uuid4().hex[:10]}") if backend == "postgresql" and pg else None
                    cell = await run_cell(model, tensors, root / f"{backend}-{pipeline}-{workers}-{rnd}", workers,
                                          args.jobs, url, pipeline)
                    cell["round"] = rnd
                    results[backend].append(cell)
                    log(f"{backend:10s} {pipeline:4s} workers={workers} round={rnd}: {cell['jobs_per_min']} "
                        f"jobs/min, p50 {cell['p50_ms']} ms, p95 {cell['p95_ms']} ms")
        finally:
            if pg_cm is not None:
                pg_cm.__exit__(None, None, None)
        # After the cells (its kernels compiled), on a thread of its own as a worker runs it.
        q_ms = await asyncio.to_thread(quantize_ms, model, root)
        log(f"pipeline alone: {q_ms:.1f} ms per model")
        summary = []
        for backend, done in results.items():
            for pipeline in args.pipelines:
                for workers in args.workers:
                    mine = [c for c in done if c["workers"] == workers and c["pipeline"] == pipeline]
                    if not mine:
                        continue
                    summary.append({"backend": backend, "pipeline": pipeline, "workers": workers,
                                    "jobs_per_min": statistics.median(c["jobs_per_min"] for c in mine),
                                    "p50_ms": statistics.median(c["p50_ms"] for c in mine),
                                    "p95_ms": statistics.median(c["p95_ms"] for c in mine)})
        base = {(s["pipeline"], s["workers"]): s for s in summary if s["backend"] == "sqlite"}
        for s in summary:
            ref = base.get((s["pipeline"], s["workers"]))
            s["throughput_vs_sqlite"] = round(s["jobs_per_min"] / ref["jobs_per_min"], 2) if ref else None
        return {"benchmark": "queue", "machine": machine_info(), "jobs_per_cell": args.jobs, "rounds": args.rounds,
                "model": {"tensors": tensors, "shape": [64, 64], "dtype": "float32",
                          "config": CONFIG.model_dump(mode="json", exclude_unset=True)},
                "quantize_ms": round(q_ms, 2), "baseline": "sqlite at the same worker count, same run",
                "summary": summary, "cells": results, "skipped": skipped}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=40, help="jobs submitted at once per cell")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--pipelines", nargs="+", choices=["copy", "real"], default=["copy", "real"],
                    help="copy: the queue alone (the input copied as the artifact); real: quantd's pipeline")
    ap.add_argument("--out", default="queue.json")
    args = ap.parse_args(argv)
    private_inductor_cache()
    # SIGTERM unwinds like Ctrl-C: the throwaway PostgreSQL cluster is stopped and its files removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    payload = asyncio.run(main_async(args))
    path = write_results(args.out, payload)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
