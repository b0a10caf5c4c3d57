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


def keep_kernel_cache_per_cpu() -> None:
    """For the engine run in-process outside a data dir (the CLI's ``quantize``/``analyze``): Inductor's default
    cache directory, one subdirectory per kind of CPU (:func:`cpu_kernel_tag`), unless ``TORCHINDUCTOR_CACHE_DIR``
    is set. The default (``/tmp/torchinductor_<user>``) outlives a machine in images and snapshots; this one's held
    kernels generated on an AVX2 CPU, 2–3x slower on the AVX-512 one that later served them."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(default_cache_dir()) / cpu_kernel_tag())


def keep_kernel_cache_in(data_dir: Path) -> None:
    """Inductor's cache of compiled kernels under ``data_dir/.inductor-cache/<machine-isa>`` unless
    ``TORCHINDUCTOR_CACHE_DIR`` says otherwise: the service writes nothing outside its data dir (Inductor's
    default is ``/tmp/torchinductor_<user>``), and a restart finds its kernels. One directory per vector ISA
    (:func:`cpu_kernel_tag`): Inductor's graph cache does not key on it, and a data dir moved to a CPU with
    another one got the first CPU's code (bfloat16 kernels made on an AVX2 machine ran 2–3x slower on an
    AVX-512 one, measured here)."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(data_dir).resolve() / ".inductor-cache" / cpu_kernel_tag())


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
