"""Process entry points the CLI calls: ``run_server`` (API + embedded workers) and ``run_worker``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
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


# glibc's mallopt parameters (malloc.h) and the sizes set by keep_freed_memory.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
KEPT_BYTES = 1 << 30


def keep_freed_memory(enabled: bool) -> bool:
    """Have glibc's malloc serve blocks up to :data:`KEPT_BYTES` from its heap, keep up to that much freed
    memory there (not returned to the system), and give every thread the one heap (arena); True when set.
    Process-wide, and to be called before threads start: a thread that took an arena of its own keeps it
    (and a new thread may inherit one an exited thread left).

    By default glibc maps every block of 32 MiB and more anew (its largest dynamic threshold) and unmaps it
    when freed, so every large tensor (codes, a float32 copy, x̂ for the statistics) faults its pages in again:
    ~0.9 µs per 4 KiB page on this VM, more than the kernel that fills it. Measured here (2 threads, in a
    worker thread): one 11008×4096 float32 weight quantized int8 per-channel 18.5 → 8.1 ms, with its
    dequantize 59.3 → 13.8 ms; a 720 MB model of four such weights, warm, 12 runs cycling int4 g128 /
    int8 per-channel / nf4 g64: 0.39–0.40 → 0.25, 0.34–0.47 → 0.26 and 0.47–0.55 → 0.38 s, with peak RSS
    719 → 820 MB, steady over the runs (RSS between jobs: ~500 → 820 MB). The price: the process keeps
    freed memory (up to 1 GiB at the heap's top, and without bound the holes that blocks of other sizes
    leave below it), as jemalloc and tcmalloc setups for PyTorch on CPU do. Other C libraries: nothing
    is done."""
    if not enabled or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc only (musl's mallopt takes none of these)
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = [mallopt(_M_ARENA_MAX, 1), mallopt(_M_MMAP_THRESHOLD, KEPT_BYTES), mallopt(_M_TRIM_THRESHOLD, KEPT_BYTES)]
    return all(done)


def keep_freed_memory_as_configured() -> bool:
    """:func:`keep_freed_memory` as ``QUANTD_KEEP_FREED_MEMORY`` says (the setting's default when unset),
    for the CLI's in-process runs, which read no other setting."""
    from pydantic import TypeAdapter, ValidationError

    from .settings import SettingsError

    raw = next((v for k, v in os.environ.items() if k.upper() == "QUANTD_KEEP_FREED_MEMORY"), None)  # as Settings
    try:
        enabled = Settings.model_fields["keep_freed_memory"].default if raw is None else TypeAdapter(bool).validate_python(raw)
    except ValidationError:
        raise SettingsError("QUANTD_KEEP_FREED_MEMORY: not a boolean (1/0, true/false, on/off, yes/no)") from None
    return keep_freed_memory(enabled)


def run_server(settings: Settings) -> None:
    """Serve the API with uvicorn (one process; its embedded workers run inside it). The CLI has set malloc
    (:func:`keep_freed_memory`) before this imports torch."""
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
    ``settings.workers`` of 0 or unset = one per device. The CLI has set malloc (:func:`keep_freed_memory`)
    before this imports torch."""
    from quantd.jobs import run_worker as run_jobs_worker

    from .app import jobs_config, start_warm_up

    configure_logging(settings.log_level)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    keep_kernel_cache_in(settings.data_dir)
    if settings.warmup:
        start_warm_up()
    run_jobs_worker(jobs_config(settings, workers=settings.workers or None))
