"""Settings of the job layer and the resolution of ``device``/``workers`` into worker devices."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from quantd.errors import ConfigError

# What a device setting may be: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
DEVICE_RE = re.compile(r"auto|cpu|cuda|cuda:\d+")


@dataclass(frozen=True)
class JobsConfig:
    """``workers``: None = one per CUDA device (one CPU worker without CUDA); 0 = no embedded
    workers (API-only, ``quantd worker`` processes run apart); N = N workers spread round-robin
    over the devices. Times are seconds. ``quantize_during_upload``: a safetensors job upload is
    quantized tensor by tensor while it streams in, in place of an idle embedded worker (see
    ``quantd.jobs.prepared``); None = when :func:`room_to_overlap` says so."""

    data_dir: Path
    workers: int | None = None
    device: str = "auto"
    lease_s: float = 30.0
    heartbeat_s: float = 5.0
    max_attempts: int = 3
    ttl_s: float = 7 * 24 * 3600.0
    max_queue: int = 1000
    reap_interval_s: float = 10.0
    poll_s: float = 0.5  # idle worker poll of the queue (other processes' submissions)
    events_poll_s: float = 0.2
    progress_write_s: float = 0.1  # progress is written to the DB at most this often
    queue_full_retry_after_s: int = 5
    cancel_wait_s: float = 2.0  # DELETE of a running job waits this long for its worker to end it cancelled
    quantize_during_upload: bool | None = None
    # Backends by URL (quantd.jobs.backends): None = SQLite and files under data_dir.
    database_url: str | None = None
    storage_url: str | None = None
    s3_endpoint_url: str | None = None
    storage_presign: bool = False  # artifacts in an object store: a redirect to a presigned URL
    migrate: bool = True  # apply pending database migrations at start (PostgreSQL)
    # Data by reference: the s3:// prefixes each tenant may read and write ("*": every tenant).
    source_prefixes: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        if not DEVICE_RE.fullmatch(self.device):
            raise ConfigError(f"{self.device!r} is not auto, cpu, cuda or cuda:N", field="device")
        if self.workers is not None and self.workers < 0:
            raise ConfigError(f"{self.workers} < 0", field="workers")
        if self.max_attempts < 1:
            raise ConfigError(f"{self.max_attempts} < 1", field="max_attempts")
        if self.max_queue < 1:
            raise ConfigError(f"{self.max_queue} < 1", field="max_queue")
        if not 0 < self.heartbeat_s < self.lease_s:
            raise ConfigError(f"needs 0 < heartbeat_s ({self.heartbeat_s}) < lease_s ({self.lease_s})",
                              field="heartbeat_s")
        for name in ("ttl_s", "reap_interval_s", "poll_s", "events_poll_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{getattr(self, name)} <= 0", field=name)


def check_device(device: str) -> int:
    """The number of CUDA devices; a ConfigError (field ``device``) when ``device`` (``auto``, ``cpu``,
    ``cuda`` or ``cuda:N``) names CUDA devices that are not there, or is none of those."""
    if not DEVICE_RE.fullmatch(device):
        raise ConfigError(f"{device!r} is not auto, cpu, cuda or cuda:N", field="device")
    if device == "cpu":
        return 0  # no CUDA probe
    available = _cuda_count()
    if device == "cuda" and available == 0:
        raise ConfigError("cuda requested but no CUDA device is available", field="device")
    if device.startswith("cuda:") and int(device.split(":")[1]) >= available:
        raise ConfigError(f"{device} requested but {available} CUDA device(s) available", field="device")
    return available


def worker_devices(config: JobsConfig) -> list[str]:
    """The device of each embedded worker, e.g. ``["cuda:0", "cuda:1"]`` or ``["cpu"]``."""
    available = check_device(config.device)
    if config.device == "cpu":
        devices = ["cpu"]
    elif config.device in ("auto", "cuda"):
        devices = [f"cuda:{i}" for i in range(available)] or ["cpu"]
    else:
        devices = [config.device]
    n = len(devices) if config.workers is None else config.workers
    return [devices[i % len(devices)] for i in range(n)]


def room_to_overlap(devices: list[str]) -> bool:
    """Whether ``quantize_during_upload="auto"`` turns it on: when the quantization runs on a CUDA device.
    On CPU workers it competes with receiving the upload for the same cores and makes the job slower
    (bench/service.py measures both modes)."""
    return any(d.startswith("cuda") for d in devices)


def _cuda_count() -> int:
    import torch  # imported here: the API process need not pay for torch until workers start

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
