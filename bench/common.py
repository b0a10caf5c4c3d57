"""Shared pieces of the benchmarks: timing, fidelity metrics, machine facts, a local quantd server.

Every benchmark runs on whatever machine it is started on; the results record that machine, and
that timings on a shared machine (other processes competing for the cores) are noisy.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from quantd.testing import LiveServer, live_server
from quantd.testing import free_port as free_port  # re-exported for the benchmarks

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
SHARED_MACHINE_NOTE = (
    "Timings were taken on a machine shared with other work: expect run-to-run noise of tens of percent; "
    "medians of several repeats are reported."
)

T = TypeVar("T")


def private_inductor_cache() -> str:
    """Give this benchmark (and the servers it starts) an Inductor cache of its own, new for the run,
    unless TORCHINDUCTOR_CACHE_DIR is set. Inductor fixes a dynamic-shape kernel's code (vector width,
    serial or parallel) at its first call and shares it through its disk cache: kernels the test suite
    compiled on tiny or odd shapes (group_size 16, say) would otherwise be timed here. First calls then
    include a cold compile, which the benchmarks report apart."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        path = tempfile.mkdtemp(prefix="quantd-bench-inductor-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def timed(
    fn: Callable[[], T], *, repeats: int, warmup: int = 1, budget_s: float = float("inf")
) -> tuple[float, list[float], T]:
    """Run ``fn`` ``warmup`` times untimed, then up to ``repeats`` (≥ 1) times, stopping early once the
    timed runs add up to ``budget_s``; returns the median seconds, all times and the last result."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    result: T
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
        if sum(times) >= budget_s:
            break
    return statistics.median(times), times, result


def fidelity(x: torch.Tensor, x_hat: torch.Tensor) -> dict[str, float]:
    """MSE, SQNR (dB, 10·log10(mean x² / mse)) and cosine of the flattened tensors, in float64."""
    a = x.detach().reshape(-1).to(torch.float64)
    b = x_hat.detach().reshape(-1).to(device=a.device, dtype=torch.float64)
    err = a - b
    mse = float(err.square().mean())
    power = float(a.square().mean())
    sqnr = float("inf") if mse == 0.0 else 10.0 * torch.log10(torch.tensor(power / mse)).item()
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    return {"mse": mse, "sqnr_db": sqnr, "cosine": cos}


def fidelity_many(xs: dict[str, torch.Tensor], x_hats: dict[str, torch.Tensor]) -> dict[str, float]:
    """Fidelity over a set of tensors taken as one long vector (MSE weighted by element count)."""
    a = torch.cat([xs[k].reshape(-1) for k in xs])
    b = torch.cat([x_hats[k].reshape(-1) for k in xs])
    return fidelity(a, b)


def outlier_weight(
    rows: int, cols: int, *, seed: int = 0, fraction: float = 0.01, factor: float = 10.0
) -> torch.Tensor:
    """Gaussian weight (std 0.02) in which a random ``fraction`` of the elements is scaled by ``factor``."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * 0.02
    mask = torch.rand(rows, cols, generator=gen) < fraction
    return torch.where(mask, w * factor, w)


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    ram_bytes = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram_bytes = int(line.split()[1]) * 1024
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cpu_isa": torch.backends.cpu.get_cpu_capability(),  # the vector ISA of ATen's and Inductor's CPU code
        "torch_threads": torch.get_num_threads(),
        "ram_bytes": ram_bytes,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "loadavg_1_5_15min": list(os.getloadavg()),
        "note": SHARED_MACHINE_NOTE,
    }


def write_results(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / name
    path.write_text(json.dumps(payload, indent=2, sort_keys=False, default=str) + "\n")
    return path


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- a local quantd server


# The process launcher the test suite uses too.
Server = LiveServer


def _wait_warm_up(server: Server, env: dict[str, str], proc: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    """Timed runs start once the server's background kernel warm-up (``QUANTD_WARMUP``) has finished, so
    that it does not compete with them: the steady state of a server, not its first minute."""
    from quantd.engine import kernels

    if env.get("QUANTD_WARMUP", "1").strip().lower() in ("0", "false", "off", "no") or not kernels.KERNELS.available():
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        text = server.log_path.read_text(errors="replace")
        if "compiled kernels ready" in text or "kernel warm-up failed" in text:
            return
        time.sleep(0.2)


@contextlib.contextmanager
def quantd_server(
    *, env: dict[str, str] | None = None, start_timeout_s: float = 60.0, workers: int = 1
) -> Iterator[Server]:
    """Start ``python -m quantd serve`` on a free loopback port with a temp data dir (this shell's
    ``QUANTD_*`` settings kept, ``env`` on top); yields once ``/readyz`` answers and the kernel warm-up
    is done, and stops it after."""
    full_env = {"QUANTD_MAX_UPLOAD_BYTES": str(4 << 30), "QUANTD_MAX_SYNC_BYTES": str(256 << 20), **(env or {})}
    with tempfile.TemporaryDirectory(prefix="quantd-bench-") as tmp, live_server(
        Path(tmp), env=full_env, inherit_quantd_env=True, workers=workers, timeout_s=start_timeout_s
    ) as server:
        _wait_warm_up(server, {**os.environ, **full_env}, server.process)
        yield server


TERMINAL = ("succeeded", "failed", "cancelled")


def wait_job(client: Any, url: str, job_id: str, *, timeout_s: float) -> dict[str, Any]:
    """Follow ``GET /v1/jobs/{id}/events`` (SSE, as the SDK does) to the terminal event and return that
    event's Job JSON; if the stream fails, poll ``GET /v1/jobs/{id}`` until a terminal status."""
    import httpx

    deadline = time.monotonic() + timeout_s
    event = None
    try:
        with client.stream("GET", f"{url}/v1/jobs/{job_id}/events", timeout=timeout_s) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if line.startswith("event:"):
                    event = line.split(":", 1)[1].strip()
                elif line.startswith("data:") and event in TERMINAL:
                    job: dict[str, Any] = json.loads(line.split(":", 1)[1])
                    return job
    except httpx.HTTPError:
        pass
    delay = 0.02
    while True:
        job = client.get(f"{url}/v1/jobs/{job_id}").raise_for_status().json()
        if job["status"] in TERMINAL:
            return job
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {job['status']} after {timeout_s}s")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)
