"""The service against the engine: what HTTP, the job queue and storage cost on a large file.

1. A ≥ 500 MB safetensors file (12 × 4096×4096 float32 tensors with different scales, written to a temp
   dir and deleted after) quantized (a) in-process by ``quantd.io.pipeline.quantize_file`` in a fresh
   Python process and (b) as a job through ``POST /v1/jobs`` on a local ``python -m quantd serve``
   (upload, queue, quantize, until ``succeeded``; the artifact download is timed apart), once with
   ``QUANTD_QUANTIZE_DURING_UPLOAD=off`` and once ``on`` (quantized tensor by tensor while the upload
   streams in). Targets: wall-time
   ratio HTTP / in-process ≤ 1.2; the server's peak RSS (VmHWM, sampled from /proc) ≤ 3 × the largest
   tensor + 500 MB.
2. Requests/s of ``POST /v1/quantize`` with a 1024×1024 float32 tensor from 8 concurrent clients for 20 s.

    python bench/service.py                  # full run (≈ 5 min on a 2-core CPU)
    python bench/service.py --quick          # smoke run: 4 × 2048×2048, one repeat, 5 s of requests
    python bench/service.py --device cuda    # both sides on the GPU (results in service_gpu.json)

With ``--device cuda`` the in-process run and the server's worker quantize on the GPU, and the peak GPU memory
of each (the in-process run's tensors, ``torch.cuda.max_memory_allocated``; the server's whole process, as
``nvidia-smi`` reports it, its CUDA context included) is recorded beside the host's RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from common import (
    Server,
    free_port,
    log,
    machine_info,
    private_inductor_cache,
    quantd_server,
    wait_job,
    write_results,
)

CONFIG = {
    "scheme": {"dtype": "int4", "symmetric": False, "granularity": "group", "group_size": 128},
    "skip_1d": True,
}

# The in-process run, in a fresh interpreter so that its time and peak memory are its own; like the
# server (which gets one warm-up job), it first quantizes a small file untimed, and it sets malloc as the
# server does.
INPROCESS = r"""
import json, sys, time
from quantd_client import QuantConfig
from quantd.io.pipeline import quantize_file
from quantd.runtime import keep_freed_memory_as_configured
keep_freed_memory_as_configured()  # as the server does (QUANTD_KEEP_FREED_MEMORY)
cfg = QuantConfig.model_validate(json.loads(sys.argv[4]))
device = sys.argv[5]
quantize_file(sys.argv[3], sys.argv[2], cfg, device=device)  # warm-up on the small file, untimed
t0 = time.perf_counter()
quantize_file(sys.argv[1], sys.argv[2], cfg, device=device)
wall = time.perf_counter() - t0
hwm = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
import torch
gpu = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
print(json.dumps({"wall_s": wall, "peak_rss_bytes": hwm, "peak_gpu_tensor_bytes": gpu}))
"""


def make_model(path: Path, count: int, side: int) -> dict[str, Any]:
    """``count`` float32 tensors of ``side × side``, tensor i ~ N(0, (0.01·(i+1))²), written one by one."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {
        f"layers.{i}.weight": torch.randn(side, side, generator=gen) * (0.01 * (i + 1)) for i in range(count)
    }
    save_file(tensors, str(path))
    largest = max(t.numel() * t.element_size() for t in tensors.values())
    return {
        "tensors": count,
        "shape": [side, side],
        "file_bytes": path.stat().st_size,
        "largest_tensor_bytes": largest,
    }


def _status_kb(pid: int, key: str) -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _process_tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
    return pids


def _gpu_used_bytes(pids: list[int]) -> int:
    """GPU memory that ``nvidia-smi`` reports in use by ``pids`` (0 when it is not there or fails)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    used = 0
    for line in out.splitlines():
        with contextlib.suppress(ValueError):
            pid, mib = (int(v) for v in line.split(","))
            if pid in pids:
                used += mib << 20
    return used


class RssSampler:
    """Samples the server's process tree every 50 ms: the largest VmHWM and the largest summed VmRSS; with
    ``gpu``, also the largest GPU memory in use by the tree (every 0.5 s, through ``nvidia-smi``)."""

    def __init__(self, pid: int, *, gpu: bool = False) -> None:
        self.pid = pid
        self.gpu = gpu
        self.peak_gpu_bytes = 0
        self.peak_hwm_kb = 0
        self.peak_tree_rss_kb = 0
        self.baseline_rss_kb = _status_kb(pid, "VmRSS")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        tick = 0
        while not self._stop.is_set():
            tree = _process_tree(self.pid)
            self.peak_hwm_kb = max([self.peak_hwm_kb, *(_status_kb(p, "VmHWM") for p in tree)])
            self.peak_tree_rss_kb = max(self.peak_tree_rss_kb, sum(_status_kb(p, "VmRSS") for p in tree))
            if self.gpu and tick % 10 == 0:
                self.peak_gpu_bytes = max(self.peak_gpu_bytes, _gpu_used_bytes(tree))
            tick += 1
            self._stop.wait(0.05)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def run_inprocess(src: Path, dst: Path, warm: Path, device: str) -> dict[str, Any]:
    os.sync()  # so that dirty pages of the previous run are not flushed on this run's time
    out = subprocess.run(
        [sys.executable, "-c", INPROCESS, str(src), str(dst), str(warm), json.dumps(CONFIG), device],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"in-process run failed ({out.returncode}): {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    dst.unlink(missing_ok=True)
    return result


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def page_cache_cost(tmp: Path, nbytes: int) -> dict[str, float]:
    """Seconds to write ``nbytes`` (no fsync) into a new file, then over the same file's cached pages.

    On a virtual machine that hands freed guest memory back to its host, every page the kernel has not
    used lately costs a host fault on first touch: writing a new file (an upload) then costs far more
    than the memory copy it is, while the in-process run reads a file already in the page cache."""
    block = os.urandom(1 << 20)
    path = tmp / "page-cache-probe.bin"
    out: dict[str, float] = {}
    for key, flags in (("new_file_s", os.O_TRUNC), ("cached_pages_s", 0)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags)
        t0 = time.perf_counter()
        for _ in range(nbytes >> 20):
            os.write(fd, block)
        out[key] = time.perf_counter() - t0
        os.close(fd)
    path.unlink()
    return out


def run_http_job(server: Server, src: Path, timeout_s: float) -> dict[str, Any]:
    import httpx

    os.sync()  # so that dirty pages of the previous run are not flushed on this run's time
    with httpx.Client(timeout=600.0) as http:
        cpu0 = _cpu_seconds(server.process.pid)
        t0 = time.perf_counter()
        with open(src, "rb") as f:
            resp = http.post(
                f"{server.url}/v1/jobs",
                data={"config": json.dumps(CONFIG)},
                files={"file": (src.name, f, "application/octet-stream")},
            )
        if resp.status_code != 202:
            raise RuntimeError(f"POST /v1/jobs → {resp.status_code}: {resp.text[:500]}")
        t_accepted = time.perf_counter() - t0
        job = wait_job(http, server.url, resp.json()["id"], timeout_s=timeout_s)
        t_done = time.perf_counter() - t0
        cpu = _cpu_seconds(server.process.pid) - cpu0
        if job["status"] != "succeeded":
            raise RuntimeError(f"job {job['status']}: {job.get('error')}")
        t1 = time.perf_counter()
        nbytes = 0
        with http.stream("GET", f"{server.url}/v1/jobs/{job['id']}/artifact") as r:
            r.raise_for_status()
            for chunk in r.iter_bytes():
                nbytes += len(chunk)
        t_download = time.perf_counter() - t1
        http.delete(f"{server.url}/v1/jobs/{job['id']}")
    return {
        "wall_s": t_done,
        "server_cpu_s": cpu,
        "upload_accepted_s": t_accepted,
        "download_s": t_download,
        "artifact_bytes": nbytes,
        "server_elapsed_s": (job.get("result") or {}).get("summary", {}).get("elapsed_s"),
    }


# The floor under any upload to a uvicorn server on the machine: an ASGI app that reads the body and
# drops it (no multipart parsing, no hashing, no file), receiving the same request from the same client.
DISCARD_APP = """
async def app(scope, receive, send):
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})
"""


def raw_upload_floor(src: Path, tmp: Path, repeats: int) -> list[float]:
    """Seconds to POST ``src`` as the HTTP job does, to :data:`DISCARD_APP` on uvicorn."""
    import httpx

    (tmp / "discard_app.py").write_text(DISCARD_APP)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "discard_app:app", "--app-dir", str(tmp), "--port", str(port),
         "--lifespan", "off", "--log-level", "warning"],
    )
    times: list[float] = []
    try:
        with httpx.Client(timeout=600.0) as http:
            deadline = time.monotonic() + 30
            while True:
                try:
                    http.post(f"http://127.0.0.1:{port}/", content=b"")
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            for _ in range(repeats):
                t0 = time.perf_counter()
                with open(src, "rb") as f:
                    http.post(
                        f"http://127.0.0.1:{port}/",
                        data={"config": json.dumps(CONFIG)},
                        files={"file": (src.name, f, "application/octet-stream")},
                    ).raise_for_status()
                times.append(time.perf_counter() - t0)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return times


def timed_copy(src: Path, dst: Path) -> float:
    """Seconds to copy ``src`` into a new file beside it and fsync it: the floor under storing an upload
    of the same size on this file system (an HTTP job must persist its input before answering 202)."""
    t0 = time.perf_counter()
    with src.open("rb") as fin, dst.open("wb") as fout:
        while chunk := fin.read(1 << 20):
            fout.write(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    elapsed = time.perf_counter() - t0
    dst.unlink()
    return elapsed


def large_file(repeats: int, count: int, side: int, device: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="quantd-bench-large-") as tmp:
        src, dst = Path(tmp) / "model.safetensors", Path(tmp) / "inprocess.quantd.safetensors"
        log(f"writing {count} × {side}×{side} float32")
        model = make_model(src, count, side)
        log(f"  {model['file_bytes'] / 1e6:.0f} MB")
        disk_copy_s = timed_copy(src, Path(tmp) / "copy.bin")  # what persisting an upload costs here
        log(f"  copying the file on this disk (fsync): {disk_copy_s:.1f} s")
        floor = raw_upload_floor(src, Path(tmp), repeats)
        log(f"  the same upload to a uvicorn app that drops the body: {statistics.median(floor):.2f} s")
        warm = Path(tmp) / "warm-up.safetensors"
        make_model(warm, 1, 1024)
        inproc: list[dict[str, Any]] = []
        runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        peaks: dict[str, tuple[int, int, int]] = {}
        gpu_peaks: dict[str, int] = {}
        # QUANTD_QUANTIZE_DURING_UPLOAD: "off" quantizes once the upload is stored; "on" tensor by tensor while
        # it streams in (the server's "auto" picks off on fewer than 4 cores without CUDA).
        for mode, http in runs.items():
            env = {"QUANTD_QUANTIZE_DURING_UPLOAD": mode, "QUANTD_DEVICE": device}
            if device != "cpu":  # the untimed warm-up job builds the CUDA kernels this scheme needs; the server's
                env["QUANTD_WARMUP"] = "0"  # warm-up would build those of five schemes first
            with quantd_server(workers=1, env=env) as server, RssSampler(server.process.pid,
                                                                         gpu=device != "cpu") as rss:
                run_http_job(server, warm, timeout_s=300.0)  # untimed: the worker's one-off start-up
                for i in range(repeats):  # alternate, so that load from others hits both sides alike
                    inproc.append(run_inprocess(src, dst, warm, device))
                    log(f"  in-process #{len(inproc)}: {inproc[-1]['wall_s']:.1f} s")
                    http.append(run_http_job(server, src, timeout_s=900.0))
                    log(
                        f"  HTTP job ({mode} during upload) #{i + 1}: {http[-1]['wall_s']:.1f} s "
                        f"(accepted {http[-1]['upload_accepted_s']:.1f} s, server CPU "
                        f"{http[-1]['server_cpu_s']:.1f} s; + {http[-1]['download_s']:.1f} s download)"
                    )
            peaks[mode] = (rss.peak_hwm_kb, rss.baseline_rss_kb, rss.peak_tree_rss_kb)
            gpu_peaks[mode] = rss.peak_gpu_bytes
        http = runs["off"]
        http_on = runs["on"]
        in_best, http_best = min(r["wall_s"] for r in inproc), min(r["wall_s"] for r in http)
        in_s = statistics.median(r["wall_s"] for r in inproc)
        http_s = statistics.median(r["wall_s"] for r in http)
        http_dl_s = statistics.median(r["wall_s"] + r["download_s"] for r in http)
        peak = max(p[0] for p in peaks.values()) * 1024
        budget = 3 * model["largest_tensor_bytes"] + 500 * 10**6
        http_on_s = statistics.median(r["wall_s"] for r in http_on)
        return {
            "device": device,
            "model": model,
            "config": CONFIG,
            "repeats": repeats,
            "inprocess_runs": inproc,
            "http_runs": http,
            "inprocess_wall_s": in_s,
            "http_wall_s": http_s,
            "http_with_download_wall_s": http_dl_s,
            "wall_ratio": http_s / in_s,
            "inprocess_best_wall_s": in_best,
            "http_best_wall_s": http_best,
            "wall_ratio_best": http_best / in_best,
            "wall_ratio_with_download": http_dl_s / in_s,
            "http_runs_during_upload": http_on,
            "http_wall_s_during_upload": http_on_s,
            "wall_ratio_during_upload": http_on_s / in_s,
            "median_upload_accepted_s_during_upload": statistics.median(r["upload_accepted_s"] for r in http_on),
            "median_server_cpu_s": statistics.median(r["server_cpu_s"] for r in http),
            "median_server_cpu_s_during_upload": statistics.median(r["server_cpu_s"] for r in http_on),
            "page_cache": page_cache_cost(Path(tmp), model["file_bytes"]),
            "wall_ratio_target": 1.2,
            "tmp_root": tempfile.gettempdir(),
            "disk_copy_s": disk_copy_s,
            "raw_upload_floor_runs_s": floor,
            "raw_upload_floor_s": statistics.median(floor),
            # What the ratio could be at best with this client and server stack: receiving the bytes
            # (nothing else) added to the in-process time, or, were quantization fully overlapped with
            # the upload, the larger of the two.
            "ratio_floor_sequential": (statistics.median(floor) + in_s) / in_s,
            "ratio_floor_overlapped": max(statistics.median(floor), in_s) / in_s,
            "median_upload_accepted_s": statistics.median(r["upload_accepted_s"] for r in http),
            "server_peak_rss_bytes": peak,
            "server_peak_rss_bytes_by_mode": {m: p[0] * 1024 for m, p in peaks.items()},
            "server_baseline_rss_bytes": peaks["off"][1] * 1024,
            "server_peak_tree_rss_bytes": max(p[2] for p in peaks.values()) * 1024,
            "inprocess_peak_rss_bytes": max(r["peak_rss_bytes"] for r in inproc),
            "inprocess_peak_gpu_tensor_bytes": max((r.get("peak_gpu_tensor_bytes") or 0) for r in inproc) or None,
            "server_peak_gpu_bytes_by_mode": gpu_peaks if device != "cpu" else None,
            "rss_target_bytes": budget,
            "rss_target": "3 × largest tensor + 500 MB",
        }


def _tensor_payload(side: int) -> bytes:
    from safetensors.torch import save

    w = torch.randn(side, side, generator=torch.Generator().manual_seed(1)) * 0.02
    return save({"weight": w})


async def _load(url: str, payload: bytes, clients: int, duration_s: float) -> dict[str, Any]:
    import httpx

    latencies: list[float] = []
    statuses: dict[str, int] = {}
    data = {"config": json.dumps(CONFIG)}
    deadline = time.perf_counter() + duration_s

    async def one_client(http: httpx.AsyncClient) -> None:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            try:
                r = await http.post(
                    f"{url}/v1/quantize",
                    data=data,
                    files={"file": ("w.safetensors", io.BytesIO(payload), "application/octet-stream")},
                )
                key = str(r.status_code)
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - t0)
            except httpx.HTTPError as exc:
                key = type(exc).__name__
            statuses[key] = statuses.get(key, 0) + 1

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(one_client(http) for _ in range(clients)))
        elapsed = time.perf_counter() - t0
    lat = sorted(latencies)
    return {
        "clients": clients,
        "duration_s": elapsed,
        "ok": len(lat),
        "statuses": statuses,
        "requests_per_s": len(lat) / elapsed,
        "latency_p50_s": lat[len(lat) // 2] if lat else None,
        "latency_p95_s": lat[min(len(lat) - 1, int(len(lat) * 0.95))] if lat else None,
    }


def sync_throughput(side: int, clients: int, duration_s: float, device: str) -> dict[str, Any]:
    payload = _tensor_payload(side)
    with quantd_server(workers=1, env={"QUANTD_DEVICE": device}) as server:
        asyncio.run(_load(server.url, payload, clients, min(2.0, duration_s)))  # warm-up, not recorded
        result = asyncio.run(_load(server.url, payload, clients, duration_s))
    return {"tensor_shape": [side, side], "payload_bytes": len(payload), "config": CONFIG, "device": device,
            **result}


def main(argv: list[str] | None = None) -> int:
    private_inductor_cache()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 4 × 2048×2048, 1 repeat, 5 s of requests"
    )
    ap.add_argument("--repeats", type=int, default=None, help="alternating in-process/HTTP runs (default 3)")
    ap.add_argument(
        "--out",
        default=None,
        help="file name under bench/results/ (default service.json, service_gpu.json with a CUDA device, "
        "service_quick.json with --quick)",
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda: where both sides quantize (default cpu)")
    ap.add_argument("--throughput-s", type=float, default=None,
                    help="seconds of concurrent POST /v1/quantize (default 20, 5 with --quick; 0 skips it)")
    args = ap.parse_args(argv)
    out = args.out or ("service_quick.json" if args.quick else
                       "service.json" if args.device == "cpu" else "service_gpu.json")
    repeats = args.repeats or (1 if args.quick else 3)
    count, side = (4, 2048) if args.quick else (12, 4096)
    t_start = time.perf_counter()
    payload: dict[str, Any] = {"benchmark": "service", "quick": args.quick, "machine": machine_info()}
    log("== large file: HTTP job vs in-process")
    try:
        payload["large_file"] = large_file(repeats, count, side, args.device)
        lf = payload["large_file"]
        log(
            f"  ratio {lf['wall_ratio']:.2f} (target ≤ 1.2); "
            f"server peak RSS {lf['server_peak_rss_bytes'] / 1e6:.0f} MB "
            f"(target ≤ {lf['rss_target_bytes'] / 1e6:.0f} MB)"
        )
    except Exception as exc:
        payload["large_file"] = {"error": f"{type(exc).__name__}: {exc}"}
        log(f"  failed: {exc}")
    throughput_s = args.throughput_s if args.throughput_s is not None else (5.0 if args.quick else 20.0)
    log("== POST /v1/quantize, 8 concurrent clients")
    try:
        if throughput_s <= 0:
            raise RuntimeError("skipped (--throughput-s 0)")
        payload["sync_throughput"] = sync_throughput(1024, 8, throughput_s, args.device)
        st = payload["sync_throughput"]
        log(f"  {st['requests_per_s']:.1f} req/s, p50 {st['latency_p50_s']}, statuses {st['statuses']}")
    except Exception as exc:
        payload["sync_throughput"] = {"error": f"{type(exc).__name__}: {exc}"}
        log(f"  failed: {exc}")
    payload["elapsed_s"] = time.perf_counter() - t_start
    path = write_results(out, payload)
    log(f"wrote {path} in {payload['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
