"""Process entry points the CLI calls: ``run_server`` (API + embedded workers) and ``run_worker``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from types import FrameType

from .logging import configure_logging
from .settings import Settings

log = logging.getLogger("quantd.server")


def cpu_kernel_tag() -> str:
    """The machine and the vector ISA that compiled CPU kernels are generated for (``x86_64-avx512``,
    ``x86_64-avx2``, ``aarch64-default``, ...: ATen's CPU capability, which Inductor's choice follows), and on
    Linux a short hash of the CPU's feature flags: Inductor compiles with ``-march=native`` and keys its
    compiled libraries on that literal flag, so two AVX-512 CPUs with other extensions (AMX, BF16) must not
    share them (an instruction the other lacks is a SIGILL, which no fallback catches)."""
    import hashlib
    import platform

    import torch

    tag = f"{platform.machine() or 'cpu'}-{torch.backends.cpu.get_cpu_capability()}".lower()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line.split(":", 1)[1] for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    if flags:
        tag += "-" + hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:8]
    return tag


def keep_kernel_cache_in(data_dir: Path | None) -> None:
    """Inductor's cache of compiled kernels in ``<base>/<cpu>`` (:func:`cpu_kernel_tag`) unless
    ``TORCHINDUCTOR_CACHE_DIR`` says otherwise; ``<base>`` is ``data_dir/.inductor-cache`` for ``serve`` and
    ``worker`` (the service writes nothing outside its data dir, and a restart finds its kernels), and
    Inductor's default (``/tmp/torchinductor_<user>``) for the CLI's in-process runs (``data_dir`` None).
    One directory per kind of CPU: Inductor's graph cache does not key on the vector ISA, and a cache that
    outlives its machine (a moved data dir, an image, a snapshot) served this one kernels generated on an
    AVX2 CPU, 2–3x slower on AVX-512 (measured here)."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    if data_dir is None:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        base = Path(default_cache_dir())
    else:
        base = Path(data_dir).resolve() / ".inductor-cache"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(base / cpu_kernel_tag())


def run_server(settings: Settings) -> None:
    """Serve the API with uvicorn (one process; its embedded workers run inside it)."""
    import uvicorn

    from .app import create_app

    configure_logging(settings.log_level)
    keep_kernel_cache_in(settings.data_dir)
    app = create_app(settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            state = getattr(app.state, "quantd", None)
            if state is not None:  # before uvicorn waits for open connections: end the event streams
                # Scheduled, not called: this signal handler runs on the event loop's thread, which may
                # hold the streams' lock right now (JobSignals.wait): calling in would deadlock.
                with contextlib.suppress(RuntimeError):  # no loop running: nothing is streaming
                    asyncio.get_running_loop().call_soon_threadsafe(state.jobs.close_streams)
            super().handle_exit(sig, frame)

    # log_config=None keeps our JSON handlers; the access log is ours (RequestMiddleware).
    Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, access_log=False,
                          log_level=settings.log_level.lower(), timeout_graceful_shutdown=30)).run()


def run_worker(settings: Settings) -> None:
    """Workers only (no HTTP) over the same data dir; stops gracefully on SIGINT/SIGTERM.
    ``settings.workers`` of 0 or unset = one per device."""
    from quantd.jobs import run_worker as run_jobs_worker

    from .app import jobs_config, start_warm_up

    configure_logging(settings.log_level)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    keep_kernel_cache_in(settings.data_dir)
    if settings.warmup:
        start_warm_up()
    run_jobs_worker(jobs_config(settings, workers=settings.workers or None))
