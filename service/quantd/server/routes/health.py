"""Liveness, readiness and metrics: no auth (they carry no tenant data)."""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse

from ..deps import StateDep
from ..problems import problem_responses

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: 200 while the process lives",
            responses={200: {"content": {"application/json": {"example": {"status": "ok"}}}}})
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Readiness: database, storage and at least one worker",
            responses={200: {"description": "Ready", "content": {"application/json": {
                "schema": {"type": "object", "required": ["status", "checks"], "properties": {
                    "status": {"type": "string", "enum": ["ready"]},
                    "checks": {"type": "object", "properties": {
                        "database": {"type": "boolean"}, "storage": {"type": "boolean"},
                        "workers": {"type": "integer", "description": "workers with a live heartbeat"},
                        "kernels": {"type": "string", "enum": ["compiled", "warming", "on demand", "eager"],
                                    "description": (
                            "the engine's CPU kernels: compiled; warming (being built in the background, "
                            "requests run eager meanwhile and never wait on them); on demand (no warm-up, "
                            "QUANTD_WARMUP=0: each scheme's first request or job builds its kernels while it "
                            "runs); or eager (compiling off or unavailable)")},
                        "gguf_kernels": {"type": "string", "enum": ["compiled", "warming", "eager"],
                                         "description": (
                            "the GGUF k-quant searches' kernels: compiled (built by the warm-up, or "
                            "QUANTD_COMPILE=1); warming (GGUF jobs run eager meanwhile); or eager")}}}}},
                "example": {"status": "ready", "checks": {"database": True, "storage": True, "workers": 1,
                                                          "kernels": "compiled", "gguf_kernels": "compiled"}}}}},
                **problem_responses(503)})
async def readyz(state: StateDep) -> JSONResponse:
    checks: dict[str, Any] = await anyio.to_thread.run_sync(state.jobs.ready)
    checks["kernels"] = kernels_state(warmed=state.settings.warmup)
    checks["gguf_kernels"] = gguf_kernels_state()
    workers = int(checks.get("workers", 0))
    if checks.get("database") and checks.get("storage") and workers > 0:
        return JSONResponse({"status": "ready", "checks": checks})
    failing = [k for k in ("database", "storage") if not checks.get(k)]
    if workers <= 0:
        failing.append("workers (no live worker heartbeat)")
    return JSONResponse({"type": "about:blank", "title": "Service Unavailable", "status": 503,
                         "detail": f"not ready: {', '.join(failing)}", "checks": checks},
                        status_code=503, media_type="application/problem+json", headers={"Retry-After": "5"})


def kernels_state(*, warmed: bool = True) -> str:
    """``compiled``, ``warming``, ``on demand`` (kernels on, no warm-up builds them: ``warmed`` false) or
    ``eager``: see ``/readyz``'s schema."""
    from quantd.engine.kernels import KERNELS

    if KERNELS.warming:
        return "warming"
    if not KERNELS.available():
        return "eager"
    return "compiled" if warmed else "on demand"


def gguf_kernels_state() -> str:
    """``compiled``, ``warming`` or ``eager``: see ``/readyz``'s schema."""
    from quantd.engine.ggml._common import KQUANT_KERNELS
    from quantd.engine.kernels import KERNELS, compile_setting

    if not KERNELS.available():
        return "eager"
    if KQUANT_KERNELS.built.is_set() or compile_setting() == "on":
        return "compiled"
    return "warming" if KQUANT_KERNELS.warming.is_set() else "eager"


@router.get("/metrics", summary="Prometheus text exposition", response_class=PlainTextResponse,
            responses={200: {"content": {"text/plain; version=0.0.4": {"example": (
                "# TYPE quantd_http_requests_total counter\n"
                'quantd_http_requests_total{method="GET",route="/healthz",status="200"} 3\n')}}}})
async def metrics(state: StateDep) -> PlainTextResponse:
    text = await anyio.to_thread.run_sync(state.metrics.render)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")
