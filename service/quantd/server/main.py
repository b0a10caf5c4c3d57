"""The server's entry point: ``run_server`` (API + embedded workers under uvicorn). Process set-up shared
with the worker and the CLI lives in :mod:`quantd.runtime`."""

from __future__ import annotations

import asyncio
import contextlib
from types import FrameType

from .logging import configure_logging
from .settings import Settings


def check_backends(settings: Settings) -> None:
    """Open and close the database and the file store once before the server starts: a schema to migrate
    (``QUANTD_DB_MIGRATE=0``), a database or bucket that cannot be reached end the command with the reason on
    one line (a QuantdError, which the CLI prints), not with the server's start-up traceback."""
    from quantd.jobs.backends import open_backends

    from .app import jobs_config

    store, _ = open_backends(jobs_config(settings, workers=0))
    store.close()


def run_server(settings: Settings) -> None:
    """Serve the API with uvicorn (one process; its embedded workers run inside it). The CLI has set malloc
    (:func:`quantd.runtime.keep_freed_memory`) before this imports torch."""
    import uvicorn

    from quantd.runtime import keep_kernel_cache_in

    from .app import create_app

    configure_logging(settings.log_level)
    keep_kernel_cache_in(settings.data_dir)
    check_backends(settings)
    app = create_app(settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            state = getattr(app.state, "quantd", None)
            if state is not None:  # before uvicorn waits for open connections: end the event streams
                # Scheduled, not called: this signal handler runs on the event loop's thread, which may
                # hold the streams' lock right now (JobSignals.wait): calling in would deadlock.
                with contextlib.suppress(RuntimeError):  # no loop running: nothing is streaming
                    asyncio.get_running_loop().call_soon_threadsafe(state.jobs.begin_shutdown)
            super().handle_exit(sig, frame)

    # log_config=None keeps our JSON handlers; the access log is ours (RequestMiddleware).
    Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, access_log=False,
                          log_level=settings.log_level.lower(), timeout_graceful_shutdown=30)).run()
