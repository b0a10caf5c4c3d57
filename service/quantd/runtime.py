"""Process set-up shared by every entry point (``serve``, ``worker`` and the CLI's in-process runs): glibc's
malloc, the compiled kernels' cache directory, the kernel warm-up, and the worker process's main loop.

Nothing here imports torch at module import: :func:`keep_freed_memory` must run before torch starts threads.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from quantd.server.settings import Settings
    from quantd_client import QuantConfig

log = logging.getLogger("quantd.runtime")

# QUANTD_COMPILE's values (quantd.engine.kernels.compile_setting reads them).
COMPILE_VALUES = ("auto", "1", "true", "on", "yes", "0", "false", "off", "no")


def compile_setting_error() -> str | None:
    """What is wrong with ``QUANTD_COMPILE``, or None; checked at every command's start, since the engine
    reads an unknown value as ``auto``."""
    raw = os.environ.get("QUANTD_COMPILE")
    if raw is None or not raw.strip() or raw.strip().lower() in COMPILE_VALUES:  # empty: unset, as the engine reads it
        return None
    return f"QUANTD_COMPILE: {raw!r} is not auto, 1/true/on/yes or 0/false/off/no"


# QUANTD_KEEP_FREED_MEMORY's default (serve, worker and the CLI's in-process runs).
KEEP_FREED_MEMORY_DEFAULT = True


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


def default_kernel_cache_base() -> Path:
    """Inductor's own default cache directory (``$TMPDIR/torchinductor_<user>``), computed as Inductor does
    without importing it."""
    import getpass
    import re
    import tempfile

    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):  # no name for this uid (a container's arbitrary user)
        getuid = getattr(os, "getuid", None)
        user = f"uid_{getuid()}" if callable(getuid) else "unknown_user"
    return Path(tempfile.gettempdir()) / ("torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def keep_kernel_cache_in(data_dir: Path | None) -> None:
    """Inductor's cache of compiled kernels in ``<base>/<cpu>`` (:func:`cpu_kernel_tag`) unless
    ``TORCHINDUCTOR_CACHE_DIR`` says otherwise; ``<base>`` is ``data_dir/.inductor-cache`` for ``serve`` and
    ``worker`` (the service writes nothing outside its data dir, and a restart finds its kernels), and
    Inductor's default (``/tmp/torchinductor_<user>``) for the CLI's in-process runs (``data_dir`` None).
    One directory per kind of CPU: Inductor's graph cache does not key on the vector ISA, and a cache that
    outlives its machine (a moved data dir, an image, a snapshot) would serve kernels generated for another
    CPU: slower ones, or instructions this CPU lacks."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    base = default_kernel_cache_base() if data_dir is None else Path(data_dir).resolve() / ".inductor-cache"
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
    when freed, so every large tensor (codes, a float32 copy, x̂ for the statistics) faults its pages in
    again, which can cost more than the kernel that fills it. The price: the process keeps freed memory
    (up to 1 GiB at the heap's top, and without bound the holes that blocks of other sizes leave below it),
    as jemalloc and tcmalloc setups for PyTorch on CPU do. Other C libraries: nothing is done."""
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
    """:func:`keep_freed_memory` as ``QUANTD_KEEP_FREED_MEMORY`` says (:data:`KEEP_FREED_MEMORY_DEFAULT` when
    unset), for the CLI's in-process runs, which read no other setting. A value that is not a boolean
    raises ValueError."""
    from pydantic import TypeAdapter, ValidationError

    raw = next((v for k, v in os.environ.items() if k.upper() == "QUANTD_KEEP_FREED_MEMORY"), None)  # as Settings
    try:
        enabled = KEEP_FREED_MEMORY_DEFAULT if raw is None else TypeAdapter(bool).validate_python(raw)
    except ValidationError:
        raise ValueError("QUANTD_KEEP_FREED_MEMORY: not a boolean (1/0, true/false, on/off, yes/no)") from None
    return keep_freed_memory(enabled)


# Under QUANTD_COMPILE=auto a one-shot GGUF run compiles its kernels when it quantizes at least this many
# weights to ggml types per torch thread: from there the build on a cold kernel cache (about a minute on 2
# cores) costs less than the kernels save over the eager chunk loops (Q4_K_M on 2 cores: 57 against 23 ns per
# weight). bench/gguf_oneshot.py measures the break-even: about 2 billion weights on 2 threads. Scaling it by the
# threads is an estimate, on the safe side: the quantization's time shrinks with the threads, the build's less.
ONE_SHOT_GGUF_KERNEL_WEIGHTS_PER_THREAD = 1_000_000_000
# The same where the kernel cache already holds every GGUF kernel (a GGUF warm-up filled it: serve, worker or
# ``quantd warm-up``): loading them costs seconds, not a build, and bench/gguf_oneshot.py puts the break-even
# at 0.23 to 0.29 billion weights on 2 threads (0.12 to 0.15 a thread) in its runs.
WARM_GGUF_KERNEL_WEIGHTS_PER_THREAD = 150_000_000
_GGUF_WARM_MARK = "quantd-gguf-kernels-{}.ok"


def _gguf_kernels_key() -> str:
    """What the cached GGUF kernels depend on: Python's and torch's versions, the C++ compiler Inductor calls,
    and the source of the code they are traced and compiled from (a change to any makes Inductor build them
    again)."""
    import hashlib

    import torch

    import quantd.engine.ggml as ggml
    import quantd.engine.kernels as kernels
    import quantd.io.outputs.gguf as gguf_out

    h = hashlib.sha256(f"{sys.version} {torch.__version__} {os.environ.get('CXX', '')}".encode())
    for d in (Path(ggml.__file__).parent, Path(kernels.__file__).parent):
        for f in sorted(d.glob("*.py")):
            h.update(f.read_bytes())
    h.update(Path(gguf_out.__file__).read_bytes())
    return h.hexdigest()[:16]


def _fx_graph_cache_on() -> bool:
    """Whether Inductor keeps compiled graphs on disk (``TORCHINDUCTOR_FX_GRAPH_CACHE``): without it a warm-up
    fills no cache a later process can load."""
    from torch._inductor import config

    return bool(config.fx_graph_cache)


def _gguf_mark() -> Path | None:
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return Path(cache) / _GGUF_WARM_MARK.format(_gguf_kernels_key()) if cache else None


def mark_gguf_kernels_cached(*, strict: bool = False) -> None:
    """Note in the kernel cache (``TORCHINDUCTOR_CACHE_DIR``) that a GGUF warm-up has filled it, for this
    torch and this code; nothing without a cache dir set or with Inductor's graph cache off. ``strict``
    (``quantd warm-up``): a mark that cannot be written raises OSError rather than a logged warning."""
    mark = _gguf_mark()
    if mark is None or not _fx_graph_cache_on():
        if strict:
            raise OSError("Inductor's graph cache is off (TORCHINDUCTOR_FX_GRAPH_CACHE=0): nothing to keep warm")
        return
    try:
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.touch()
    except OSError as e:
        if strict:
            raise OSError(f"could not mark the kernel cache warm: {e}") from None
        log.warning("could not mark the GGUF kernels cached: %s", e)


def gguf_kernels_cached() -> bool:
    """Whether a GGUF warm-up has filled this process's kernel cache for this torch and this code."""
    mark = _gguf_mark()
    return mark is not None and mark.exists() and _fx_graph_cache_on()


def use_kernels_for(path: Path, config: QuantConfig | None = None) -> bool:
    """Decide, for a one-shot run over the model at ``path`` (with ``config``, when it quantizes), whether the
    compiled kernels may run: with ``QUANTD_COMPILE=1`` always; under ``auto`` (the default) only for a GGUF
    output whose ggml-type weights reach :data:`ONE_SHOT_GGUF_KERNEL_WEIGHTS_PER_THREAD` per torch thread, or
    :data:`WARM_GGUF_KERNEL_WEIGHTS_PER_THREAD` where a GGUF warm-up has filled the kernel cache.
    Otherwise a one-shot run stays eager and never imports the compiler stack: importing Dynamo and Inductor
    and loading the cached kernels costs seconds, more than the kernels save over the eager chunk loops on the
    models ``bench/oneshot.py`` measures (91 MB and 800 MB). True when they may."""
    from quantd.engine.kernels import KERNELS, compile_setting

    if compile_setting() == "auto":
        if config is not None and config.output == "gguf" and _repays_kernels(path, config):
            from quantd.engine.ggml._common import take_kernels

            take_kernels()
        else:
            KERNELS.reset(available=False)
    return KERNELS.available()


def _repays_kernels(path: Path, config: QuantConfig) -> bool:
    import torch

    from quantd.io.outputs.gguf import ggml_weights

    per_thread = WARM_GGUF_KERNEL_WEIGHTS_PER_THREAD if gguf_kernels_cached() else ONE_SHOT_GGUF_KERNEL_WEIGHTS_PER_THREAD
    return ggml_weights(path, config) >= per_thread * torch.get_num_threads()


# The warm-up builds the kernels once no request has been in flight for this long (the first requests to a new
# server are answered without it competing for the cores and the interpreter), or at the latest this long after
# it was started, busy or not.
WARM_UP_QUIET_S = 1.0
WARM_UP_MAX_WAIT_S = 60.0
# The warm-up thread's niceness (Linux, per thread; Inductor's compiler processes inherit it).
WARM_UP_NICE = 10


class RequestActivity:
    """Requests in flight, counted by the server's middleware, so that the warm-up builds the kernels in a
    quiet moment."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._since = time.monotonic()

    def enter(self) -> None:
        with self._lock:
            self._in_flight += 1

    def leave(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._since = time.monotonic()

    def quiet_for(self) -> float:
        """Seconds since the last request ended with none in flight since (0 while one is)."""
        with self._lock:
            return 0.0 if self._in_flight else time.monotonic() - self._since


def _lower_this_thread_priority() -> None:
    """Raise the calling thread's niceness to :data:`WARM_UP_NICE` where the OS has per-thread priorities
    (Linux); elsewhere, or when refused, nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), WARM_UP_NICE))
    except (AttributeError, OSError):
        pass


@dataclass
class WarmUp:
    """The state of a background kernel warm-up: ``done`` is set when it has ended (built, failed, or
    nothing to build)."""

    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    seconds: float | None = None
    thread: threading.Thread | None = None


def start_warm_up(activity: RequestActivity | None = None, *, gguf: bool = True,
                  devices: Sequence[str] = ("cpu",)) -> WarmUp:
    """Build the engine's compiled kernels for the common schemes on ``devices`` (the CPU and each CUDA device
    that runs jobs) in a background thread at a lower OS
    priority; with ``activity`` (a server's requests), once no request has been in flight for
    :data:`WARM_UP_QUIET_S` (at the latest :data:`WARM_UP_MAX_WAIT_S` after this call). Until it ends, the
    kernels are held by it (``KERNELS.hold``): requests and jobs meanwhile run on the eager path instead of
    waiting for a compile. After it, a variant it did not build (another scheme, dtype or shape) runs eager for
    the request or job that meets it while a background thread builds it (``KERNELS.build_in_background``).
    Logs when it starts, when it begins building, and when it ends.

    With ``gguf``, the same thread then builds the GGUF k-quant searches' kernels (minutes on a cold cache,
    under a minute from the disk cache) without holding the others: jobs of other formats take their compiled
    kernels meanwhile, and GGUF jobs run eager until that build ends, then compiled."""
    from quantd.engine.kernels import KERNELS

    state = WarmUp()

    def run() -> None:
        from quantd.io.pipeline import warm_up

        deadline = time.monotonic() + WARM_UP_MAX_WAIT_S
        while activity is not None and activity.quiet_for() < WARM_UP_QUIET_S and time.monotonic() < deadline:
            time.sleep(0.05)  # poll step: requests come first
        _lower_this_thread_priority()
        if KERNELS.available():
            log.info("kernel warm-up building the compiled kernels")
        start = time.perf_counter()
        took = None
        try:
            with KERNELS.building():  # this thread builds what it meets, whatever else is on
                took = warm_up(devices=devices)
        except Exception as e:  # a failed warm-up only means the first real tensor compiles (or runs eager)
            state.error = f"{type(e).__name__}: {e}"
            log.exception("kernel warm-up failed")
        else:
            state.seconds = time.perf_counter() - start
            if took is None:
                log.info("kernel warm-up skipped: compiled kernels are off")
            else:
                log.info("compiled kernels ready", extra={"warmup_s": round(took, 1), "devices": list(devices)})
        finally:
            if KERNELS.available():  # from now on a variant the warm-up did not build is built in the background
                KERNELS.build_in_background(_lower_this_thread_priority)
            KERNELS.release()
            state.done.set()
        if gguf and took is not None:  # built, not failed or off
            with KERNELS.building():  # this thread builds the GGUF kernels itself, not the background one
                _warm_up_gguf()

    state.thread = threading.Thread(target=run, name="quantd-warmup", daemon=True)
    if KERNELS.available():
        KERNELS.hold(state.thread)  # before any request can arrive
        log.info("kernel warm-up started: it builds the kernels once no request has been in flight for %g s; "
                 "requests run eager until it ends", WARM_UP_QUIET_S if activity is not None else 0)
    state.thread.start()
    return state


def _warm_up_gguf() -> None:
    """The GGUF part of :func:`start_warm_up`, in its thread: a failure leaves GGUF jobs on the eager path."""
    from quantd.io.outputs.gguf import warm_up_gguf

    log.info("kernel warm-up building the GGUF k-quant kernels; GGUF jobs run eager until it ends")
    try:
        took = warm_up_gguf()
    except Exception:
        log.exception("GGUF kernel warm-up failed")
        return
    if took is not None:
        log.info("GGUF k-quant kernels ready", extra={"warmup_s": round(took, 1)})
        mark_gguf_kernels_cached()


def run_worker(settings: Settings) -> None:
    """Workers only (no HTTP) over the same data dir; stops gracefully on SIGINT/SIGTERM.
    ``settings.workers`` of 0 or unset = one per device. The caller has set malloc (:func:`keep_freed_memory`)
    before this imports torch."""
    from quantd.jobs import run_worker as run_jobs_worker
    from quantd.server.app import jobs_config
    from quantd.server.logging import configure_logging

    configure_logging(settings.log_level)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    keep_kernel_cache_in(settings.data_dir)
    config = jobs_config(settings, workers=settings.workers or None)
    if settings.warmup:
        from quantd.jobs import worker_devices

        devices = worker_devices(config)
        start_warm_up(gguf=settings.warmup_gguf and "cpu" in devices, devices=devices)  # GGUF: CPU engines only
    run_jobs_worker(config)
