"""``create_app(settings)``: the FastAPI application, its typed state and its lifespan.

The lifespan starts the job service (SQLite store, storage, and the embedded workers unless
``workers == 0`` or ``embedded_workers`` is off) and stops it on shutdown. Importing this module
does nothing heavy: torch and the job layer are imported when the app starts."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, get_args

import anyio
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

import quantd
from quantd import runtime
from quantd_client import DeviceInfo
from quantd_client._schemas import JobStatus

from .deps import AppState
from .logging import RequestMiddleware
from .metrics import Metrics
from .problems import install_problem_handlers
from .routes import docs_ui, health, info, jobs, sync
from .routes._docs import finish_openapi, without_auth
from .settings import Settings, parse_source_prefixes

log = logging.getLogger("quantd.server")

DESCRIPTION = """Quantization service for ML weights.

Errors are RFC 9457 `application/problem+json`. When API keys are configured every `/v1` call needs
`Authorization: Bearer <key>`. Uploads are multipart, streamed to disk; see each endpoint's request body."""


def jobs_config(settings: Settings, *, workers: int | None) -> Any:
    from quantd.jobs import JobsConfig

    return JobsConfig(data_dir=settings.data_dir, workers=workers, device=settings.device,
                      lease_s=settings.lease_s, heartbeat_s=min(5.0, settings.lease_s / 3),
                      ttl_s=settings.job_ttl_s, max_queue=settings.max_queue,
                      quantize_during_upload={"auto": None, "on": True, "off": False}[
                          settings.quantize_during_upload],
                      database_url=settings.database_url.get_secret_value() if settings.database_url else None,
                      storage_url=settings.storage_url, s3_endpoint_url=settings.s3_endpoint_url,
                      storage_presign=settings.storage_presign, migrate=settings.db_migrate,
                      source_prefixes=parse_source_prefixes(settings.source_prefixes or ""))


def embedded_worker_count(settings: Settings) -> int | None:
    """Workers inside the API process: None = one per CUDA device (one CPU worker without CUDA)."""
    return settings.workers if settings.embedded_workers else 0


def sync_device(device: str) -> str:
    """The device of the synchronous endpoints: ``auto`` → the first CUDA device, else CPU."""
    import torch

    if device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    return "cuda:0" if device == "cuda" else device


def list_devices() -> list[DeviceInfo]:
    import torch

    out = [DeviceInfo(name="cpu", type="cpu", memory_bytes=_host_memory())]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            out.append(DeviceInfo(name=f"cuda:{i}", type="cuda", memory_bytes=int(props.total_memory)))
    return out


def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _register_gauges(metrics: Metrics, state: AppState) -> None:
    def jobs_by_status() -> list[tuple[tuple[tuple[str, str], ...], float]]:
        counts = state.jobs.counts_by_status()
        return [((("status", s),), float(counts.get(s, 0))) for s in get_args(JobStatus)]

    metrics.gauge("quantd_jobs", "jobs by status", jobs_by_status)
    metrics.counter_source("quantd_quantized_bytes_total", lambda: float(state.jobs.succeeded_input_bytes()))
    metrics.gauge("quantd_queue_depth", "jobs queued", lambda: [((), float(state.jobs.queue_depth()))])
    metrics.gauge("quantd_workers_busy", "workers (any process) running a job",
                  lambda: [((), float(state.jobs.busy_workers()))])
    metrics.gauge("quantd_upload_runs", "quantizations started while their upload streamed in (counter), and "
                  "those whose artifact became their job's",
                  lambda: [((("outcome", k),), float(v)) for k, v in state.jobs.upload_runs().items()])
    metrics.gauge("quantd_workers_live", "workers (any process) with a recent heartbeat",
                  lambda: [((), float(state.jobs.live_workers()))])


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()
    activity = runtime.RequestActivity()  # the warm-up waits for a quiet moment

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from quantd.jobs import JobService

        settings.warn_unsafe()
        settings.tmp_dir.mkdir(parents=True, exist_ok=True)
        keys = settings.tenant_keys()
        device = await anyio.to_thread.run_sync(sync_device, settings.device)
        devices = await anyio.to_thread.run_sync(list_devices)
        service = JobService(jobs_config(settings, workers=embedded_worker_count(settings)))
        await service.start()
        state = AppState(
            settings=settings, metrics=metrics, jobs=service, sync_device=device, devices=devices,
            key_digests=[(hashlib.sha256(k.encode()).digest(), t) for k, t in keys.items()],
            sync_limiter=anyio.CapacityLimiter(settings.sync_concurrency),
            check_limiter=anyio.CapacityLimiter(settings.sync_concurrency),
        )
        _register_gauges(metrics, state)
        app.state.quantd = state
        from quantd.jobs import worker_devices

        workers = ([] if service.config.workers == 0
                   else await anyio.to_thread.run_sync(worker_devices, service.config))
        if settings.warmup:
            # GGUF's k-quant kernels serve CPU engines only: CUDA workers run GGUF jobs on the eager ops.
            devices = list(dict.fromkeys([device, *workers]))  # the sync requests' device and the workers'
            runtime.start_warm_up(activity, gguf=settings.warmup_gguf and "cpu" in devices, devices=devices)
        log.info("quantd started", extra={"data_dir": str(settings.data_dir), "auth": bool(keys),
                                          "embedded_workers": len(workers), "worker_devices": workers,
                                          "sync_device": device})
        try:
            yield
        finally:
            app.state.quantd = None
            await service.stop()
            log.info("quantd stopped")

    app = FastAPI(title="quantd", version=quantd.__version__, description=DESCRIPTION, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    install_problem_handlers(app)
    for module in (health, info, sync, jobs):
        app.include_router(module.router)
    docs_ui.install(app)
    app.add_middleware(RequestMiddleware, metrics=metrics, activity=activity)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            schema = finish_openapi(schema)
            state: AppState | None = getattr(app.state, "quantd", None)
            keyed = state.auth_enabled if state is not None else bool(settings.tenant_keys())
            app.openapi_schema = schema if keyed else without_auth(schema)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
