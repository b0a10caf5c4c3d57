"""Process entry points the CLI calls: ``run_server`` (API + embedded workers) and ``run_worker``."""

from __future__ import annotations

import asyncio
import logging
import signal

from .logging import configure_logging
from .settings import Settings

log = logging.getLogger("quantd.server")


def run_server(settings: Settings) -> None:
    """Serve the API with uvicorn (one process; its embedded workers run inside it)."""
    import uvicorn

    from .app import create_app

    configure_logging(settings.log_level)
    app = create_app(settings)
    # log_config=None keeps our JSON handlers; the access log is ours (RequestMiddleware).
    uvicorn.run(app, host=settings.host, port=settings.port, log_config=None, access_log=False,
                log_level=settings.log_level.lower(), timeout_graceful_shutdown=30)


def run_worker(settings: Settings, *, workers: int | None = None) -> None:
    """Workers only (no HTTP), over the same data dir; stops on SIGINT/SIGTERM."""
    from quantd.jobs import JobService

    from .app import jobs_config

    configure_logging(settings.log_level)
    n = settings.workers if workers is None else workers
    service = JobService(jobs_config(settings, workers=max(1, n)))

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await service.start()
        log.info("quantd worker started", extra={"data_dir": str(settings.data_dir), "workers": max(1, n)})
        try:
            await stop.wait()
        finally:
            await service.stop()
            log.info("quantd worker stopped")

    asyncio.run(main())
