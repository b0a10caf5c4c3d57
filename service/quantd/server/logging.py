"""JSON logs, one object a line; and the ASGI middleware that gives every request an id,
logs it once (never its headers), counts it in the metrics and turns a crash into a clean 500."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import traceback
import uuid
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .metrics import Metrics

if TYPE_CHECKING:
    from quantd.runtime import RequestActivity

# Probes and scrapes: not API work, not counted as requests in flight (RequestActivity).
OPS_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})

access_log = logging.getLogger("quantd.access")
log = logging.getLogger("quantd.server")

_RID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_STD_ATTRS = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName", "color_message"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in _STD_ATTRS and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = "".join(traceback.format_exception(*record.exc_info))
        return json.dumps(out, default=str)


def configure_logging(level: str = "INFO") -> None:
    """Route the quantd and uvicorn loggers through one JSON handler on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    for name in ("quantd", "uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(level)
        lg.propagate = False


class RequestMiddleware:
    """Request id (``X-Request-ID`` in and out), one access-log line, metrics, bytes in/out, 500s."""

    def __init__(self, app: ASGIApp, metrics: Metrics, activity: RequestActivity | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.activity = activity  # API requests in flight (not the probes and scrapes of OPS_PATHS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        rid_in = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = rid_in if _RID_RE.match(rid_in) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        start = time.perf_counter()
        status = 500
        started = False
        bytes_in = 0
        bytes_out = 0

        async def receive_counted() -> Message:
            nonlocal bytes_in
            msg = await receive()
            if msg["type"] == "http.request":
                bytes_in += len(msg.get("body", b""))
            return msg

        async def send_tagged(msg: Message) -> None:
            nonlocal status, started, bytes_out
            if msg["type"] == "http.response.start":
                started = True
                status = msg["status"]
                msg["headers"] = [*msg.get("headers", []), (b"x-request-id", rid.encode())]
            elif msg["type"] == "http.response.body":
                bytes_out += len(msg.get("body", b""))
            await send(msg)

        activity = self.activity if scope.get("path", "") not in OPS_PATHS else None
        if activity is not None:
            activity.enter()
        try:
            await self.app(scope, receive_counted, send_tagged)
        except Exception as exc:
            log.error("unhandled error", exc_info=exc, extra={"request_id": rid})
            status = 500
            if not started:
                from .problems import unhandled_problem

                response = unhandled_problem(exc, rid)
                await response(scope, receive, send_tagged)  # status: set by send_tagged
        finally:
            if activity is not None:
                activity.leave()
            elapsed = time.perf_counter() - start
            route = scope.get("route")
            route_path = getattr(route, "path", None) or "<unmatched>"
            method = scope.get("method", "")
            self.metrics.observe_request(method, route_path, status, elapsed)
            self.metrics.inc("quantd_http_request_bytes_total", bytes_in)
            self.metrics.inc("quantd_http_response_bytes_total", bytes_out)
            access_log.info("request", extra={
                "request_id": rid, "method": method, "path": scope.get("path", ""), "route": route_path,
                "status": status, "duration_ms": round(elapsed * 1000, 2), "bytes_in": bytes_in,
                "bytes_out": bytes_out, "tenant": scope["state"].get("tenant"),
            })
