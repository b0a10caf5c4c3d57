"""Compiled kernels: the engine's hot loops fused by ``torch.compile`` (Inductor: C++ on CPU, Triton on CUDA).

One module here per eager module it accelerates, each kernel beside the others of its concern:
:mod:`.quantize` for ``primitives``/``qparams`` (range, qparams, encode, decode), :mod:`.packing` for
``packing``, :mod:`.stats` for ``stats``' sums and :mod:`.mse` for the mse observer's candidate errors;
this module is the switch that compiles them or sends the caller back to eager torch.

Eager torch makes one pass over memory per op; a compiled kernel makes one pass per stage (the range, the
qparams of all blocks, the encode). The kernels compute exactly what the eager formulas compute (IEEE
division, round half to even, the same clamp; tests compare them bit for bit), so whether a tensor took the
compiled or the eager path never shows in its codes, scales, packed bytes or ``x̂``. The statistics' float64
sums may differ from the eager ones in the last bits (another summation order; tests hold them to 1e-12
relative); the counts are exact.

When they run: on CPU tensors of at least :data:`MIN_ELEMENTS` elements, when a C++ compiler is found and
``QUANTD_COMPILE`` is not ``0``; on CUDA tensors of that size when Triton is installed and Inductor can be told
to keep eager CUDA's arithmetic (:func:`cuda_options`: IEEE division, no fused multiply-add, no flush of
subnormals), so that a CUDA kernel's codes equal the CPU's bit for bit. The GGUF types and HQQ stay eager on
CUDA (``cuda=False`` in :meth:`_Compiled.wants`). The first call of each kernel compiles it (Inductor caches
the result on disk for later processes); any failure to compile or run switches the CPU's kernels to the
eager path for good, with one warning; a CUDA kernel that fails to build runs eager alone, the others stay
compiled.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import shutil
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

log = logging.getLogger(__name__)

# Compiled variants kept per kernel (input dtype × output dtype × layout); past Dynamo's default of 8 a
# kernel would silently run eager.
RECOMPILE_LIMIT = 64

# Below this many elements the eager path's per-call cost is small, and a cold compile is not worth it.
MIN_ELEMENTS = 1 << 18
# Kernels that beat eager torch on small tensors too take them from this size: the one-call min-max
# kernel of integer and nf4 dtypes, and the mse search, which runs a dozen kernels per tensor.
SMALL_MIN_ELEMENTS = 1 << 12

T = TypeVar("T")

# dynamic_threads: every kernel gets an OpenMP parallel loop and the OpenMP runtime picks the threads.
# Otherwise Inductor decides serial vs parallel once, from the sizes of a kernel's first call: one first
# compiled on a tiny tensor stays serial for every later tensor of any size, in this process and, through
# Inductor's disk cache, in every later one. Per compiled function (``options``), not a global config patch.
INDUCTOR_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {"cpp.dynamic_threads": True}


# Inductor's settings that make its Triton kernels compute what eager CUDA torch computes, each under the names
# torch releases have given it: float32 division rounded to nearest (Triton's ``/`` is an approximate
# division); no multiply-add contracted into one rounding, and low-precision intermediates rounded as eager
# rounds them; subnormals kept, not flushed to zero.
_CUDA_EXACT: tuple[tuple[str, ...], ...] = (
    ("eager_numerics.division_rounding", "emulate_divison_rounding", "emulate_division_rounding"),
    ("emulate_precision_casts",),
    ("eager_numerics.disable_ftz", "disable_ftz"),
)


@functools.cache
def cuda_options() -> dict[str, bool] | None:
    """The Inductor options of the CUDA kernels (each of :data:`_CUDA_EXACT` on, under the name this torch knows),
    or None when this torch lacks one of them, or Triton: then CUDA tensors stay on the eager ops, which compute
    what the CPU's compute. Asked once per process (it imports the compiler)."""
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return None
    if not has_triton():
        return None
    options = {}
    known = _known_options()
    for names in _CUDA_EXACT:
        found = next((name for name in names if name in known), None)
        if found is None:
            return None
        options[found] = True
    return options


@functools.lru_cache(maxsize=1)
def _known_options() -> frozenset[str]:
    from torch._inductor import list_options

    return frozenset(list_options())


def _supported(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` without the Inductor settings this torch does not know (tuning knobs of later releases):
    the kernel compiles with that setting's default rather than not at all."""
    known = _known_options()
    return {k: v for k, v in options.items() if k in known}


def compile_setting() -> str:
    """``QUANTD_COMPILE``: ``off`` (``0``/``false``/``no``), ``on`` (``1``/``true``/``yes``: compile whenever
    a kernel applies) or ``auto`` (the default: long-lived processes compile, one-shot runs stay eager but
    large GGUF ones, ``quantd.runtime.use_kernels_for``)."""
    setting = os.environ.get("QUANTD_COMPILE", "auto").strip().lower()
    # the same spellings as quantd.runtime.COMPILE_VALUES, which the CLI checks without importing torch
    if setting in ("0", "false", "off", "no"):
        return "off"
    return "on" if setting in ("1", "true", "on", "yes") else "auto"


@functools.cache
def _limit_names() -> tuple[str, type[BaseException]]:
    """Dynamo's setting for the variants kept per function and the error a ``fullgraph`` call raises past it, as
    the running torch names them (earlier releases: ``cache_size_limit`` and ``FailOnCacheLimitHit``)."""
    config, exc = torch._dynamo.config, torch._dynamo.exc
    setting = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    error = getattr(exc, "FailOnRecompileLimitHit", None) or getattr(exc, "FailOnCacheLimitHit", None)
    return setting, error or _NeverRaised


class _NeverRaised(Exception):
    """Stands for the recompile-limit error where a torch has none (its calls then fall back as any failure)."""


@contextlib.contextmanager
def _recompile_limit() -> Iterator[None]:
    """Dynamo's recompile limit at :data:`RECOMPILE_LIMIT` for a call (a warm variant may still recompile, on a
    new stride or a size of 1). Dynamo's config values are context variables, so each thread sets and restores
    its own; set directly, as ``config.patch`` costs as much as a small kernel's call."""
    config, setting = torch._dynamo.config, _limit_names()[0]
    old = getattr(config, setting)
    setattr(config, setting, RECOMPILE_LIMIT)
    try:
        yield
    finally:
        setattr(config, setting, old)


def _unviewed(a: Any) -> Any:
    """A view as a plain tensor on the same storage (no copy), with the dims ``mark_static`` marked on it still
    marked; anything else as it is. Dynamo guards on a view's base, so the same shapes cut from a 1-D file
    buffer and from a 2-D tensor would otherwise be two variants, and a job's tensors would compile again
    after a warm-up built their kernels."""
    if not (isinstance(a, torch.Tensor) and a._is_view()):
        return a
    plain = a.detach()
    for dim in getattr(a, "_dynamo_static_indices", ()):  # where mark_static records its marks
        torch._dynamo.mark_static(plain, dim)
    return plain


def _own_code(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` with a code object of its own (the CUDA kernels' copy): Dynamo keeps a function's compiled variants,
    and counts them against the recompile limit, per code object, so the CPU's and CUDA's budgets stay apart."""
    if not isinstance(fn, types.FunctionType):
        return fn
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_cuda")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


class _Compiled:
    """Lazily compiled kernels, one lock for compiling, and the switch back to eager."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fns: dict[str, Callable[..., Any]] = {}
        self._warm: set[tuple[Any, ...]] = set()
        self._broken: str | None = None
        self.failed_cuda: dict[str, str] = {}  # CUDA kernels that failed to build (eager from then on): why
        self._available: bool | None = None
        self._forced: bool | None = None  # reset(available=...): both devices' kernels on or off
        self._exhausted: set[str] = set()  # kernels past their recompile limit: eager from then on
        self._holder: threading.Thread | None = None  # while set, the only thread that takes the kernels
        # build_in_background: the one daemon thread that builds variants first met by requests and jobs
        self._builder: queue.SimpleQueue[Callable[[], None] | None] | None = None
        self._pending: set[tuple[Any, ...]] = set()  # variants queued for it
        self._pending_lock = threading.Lock()

    def available(self) -> bool:
        """Whether the CPU kernels run: compiling is on, a C++ compiler is found, and none failed."""
        if self._available is None:
            compiler = os.environ.get("CXX") or "c++"
            self._available = compile_setting() != "off" and shutil.which(compiler) is not None
        return self._available and self._broken is None

    def available_cuda(self) -> bool:
        """Whether the CUDA kernels run: compiling is on (``QUANTD_COMPILE``, or as :meth:`reset` forced it) and
        :func:`cuda_options` is not None (asked only then: it imports the compiler). A CUDA kernel that fails to
        build runs eager alone (``failed_cuda``)."""
        enabled = compile_setting() != "off" if self._forced is None else self._forced
        return enabled and cuda_options() is not None

    def wants(self, x: torch.Tensor, *, small: bool = False, cuda: bool = True) -> bool:
        """Whether ``x`` takes the compiled kernels: a tensor of at least ``MIN_ELEMENTS`` elements
        (``SMALL_MIN_ELEMENTS`` for the kernels that pay off on ``small`` ones) on the CPU, or on CUDA unless
        the caller's kernels stay eager there (``cuda=False``), when that device's kernels are available and
        no warm-up in another thread holds them."""
        least = min(MIN_ELEMENTS, SMALL_MIN_ELEMENTS) if small else MIN_ELEMENTS
        if x.numel() < least or not self._mine():
            return False
        if x.device.type == "cuda":
            return cuda and self.available_cuda()
        return x.device.type == "cpu" and self.available()

    def hold(self, thread: threading.Thread) -> None:
        """Until :meth:`release`, only ``thread`` (a warm-up building the kernels) takes them; every other
        thread runs eager meanwhile, so that no request or job waits on a compile."""
        self._holder = thread

    def release(self) -> None:
        self._holder = None

    @property
    def warming(self) -> bool:
        """Whether a warm-up holds the kernels (:meth:`hold`)."""
        return self._holder is not None

    def _mine(self) -> bool:
        holder = self._holder
        return holder is None or holder is threading.current_thread()

    def build_in_background(self, on_start: Callable[[], None] | None = None) -> None:
        """From now on (a server or worker after its warm-up), a kernel variant not built yet runs eager for
        the request or job that meets it, while one background thread builds it (``on_start`` runs first in
        that thread: a lower priority); later calls take it once built. No request or job then waits on a
        compile, which takes seconds to minutes for a scheme, dtype or shape the warm-up did not build."""
        if self._builder is not None:
            return
        jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()

        def run() -> None:  # a daemon: an exiting process never waits on a compile
            if on_start is not None:
                on_start()
            while (job := jobs.get()) is not None and not sys.is_finalizing():
                job()

        self._builder = jobs
        threading.Thread(target=run, name="quantd-kernel-build", daemon=True).start()

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """In this block, this thread builds the variants it meets itself (a warm-up), background or not."""
        was = getattr(_BUILDS_ITSELF, "on", False)
        _BUILDS_ITSELF.on = True
        try:
            yield
        finally:
            _BUILDS_ITSELF.on = was

    def _build_later(self, variant: tuple[Any, ...], fn: Callable[..., Any], name: str, key: tuple[Any, ...],
                     args: tuple[Any, ...], options: dict[str, Any] | None) -> None:
        """Queue ``variant``'s build (the call ``name, key, args, options`` as its caller made it, with its
        thread count) unless it is queued or built, or :data:`MAX_PENDING_BUILDS` are (their arguments are
        held until built)."""
        threads = torch.get_num_threads()
        with self._pending_lock:
            builder = self._builder
            if (builder is None or variant in self._pending or variant in self._warm
                    or len(self._pending) >= MAX_PENDING_BUILDS):
                return
            self._pending.add(variant)
        # copies: a view would hold its whole base (a job's buffer) until the build runs
        held = tuple(_held_copy(a) for a in args)

        def build() -> None:
            # the variant is per thread count; torch also takes it as the default of threads started later
            torch.set_num_threads(threads)
            try:
                if builder is self._builder:  # not reset meanwhile
                    with self.building():
                        self.call(name, fn, key, *held, options=options)
            finally:
                with self._pending_lock:
                    self._pending.discard(variant)

        builder.put(build)

    def call(self, name: str, fn: Callable[..., T], key: tuple[Any, ...], *args: Any,
             options: dict[str, Any] | None = None) -> T | None:
        """``fn(*args)`` compiled (with Inductor ``options`` on top of :data:`INDUCTOR_OPTIONS`), or None when
        compiling is off or failed (the caller runs eager)."""
        asked = (name, key, args, options)  # as the caller made the call (a queued build makes it again)
        device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), None)
        on_cuda = device is not None and device.type == "cuda"
        if on_cuda:  # a kernel of its own: the CUDA options, and Dynamo's variants apart (_own_code)
            name = f"{name}@cuda"
        if name in self._exhausted or not self._mine() or not (self.available_cuda() if on_cuda
                                                                 else self.available()):
            return None
        if on_cuda:  # host constants (a threshold) go with the kernel: one graph, one device
            args = tuple(a.to(device) if isinstance(a, torch.Tensor) and a.device != device else a for a in args)
            options = {**(options or {}), **(cuda_options() or {})}
        key = (*key, torch.get_num_threads())  # Dynamo recompiles when the thread count changes
        args = tuple(_unviewed(a) for a in args)
        try:
            with _recompile_limit():
                if (name, *key) in self._warm:
                    return self._fns[name](*args)  # type: ignore[no-any-return]
                if self._builder is not None and not getattr(_BUILDS_ITSELF, "on", False):
                    self._build_later((name, *key), fn, *asked)
                    return None  # eager this time
                with self._lock:  # the first call of a variant compiles: one thread at a time
                    compiled = self._fns.get(name)
                    if compiled is None:
                        compiled = self._fns[name] = torch.compile(
                            _own_code(fn) if on_cuda else fn, dynamic=True, fullgraph=True,
                            options=_supported({**INDUCTOR_OPTIONS, **(options or {})}))
                    with warnings.catch_warnings():  # the compiler's own warnings are not ours to raise
                        warnings.simplefilter("ignore")
                        out = compiled(*args)
                    self._warm.add((name, *key))
                    return out  # type: ignore[no-any-return]
        except torch.cuda.OutOfMemoryError:  # the device is full for now (another job): eager this time, not for good
            return None
        except _limit_names()[1]:  # this kernel's variants are used up, not the toolchain
            self._exhausted.add(name)
            log.warning("compiled kernel %r has %d variants in this process: it runs eager from now on",
                        name, RECOMPILE_LIMIT)
            return None
        except Exception as e:  # any compiler or toolchain failure: fall back, never fail the job
            if sys.is_finalizing():  # the process is exiting under a compile: no verdict on the toolchain
                return None
            reason = f"{type(e).__name__}: {e}"
            if on_cuda:  # Triton fails kernel by kernel: this one runs eager from now on, the others stay compiled
                self._exhausted.add(name)
                self.failed_cuda[name] = reason
                log.warning("compiled CUDA kernel %r failed to build, it runs eager: %s", name,
                            reason.splitlines()[0][:300])
                return None
            self._broken = reason
            log.warning("compiled kernels disabled on the CPU, using eager torch: %s", reason.splitlines()[0][:300])
            return None

    def reset(self, *, available: bool | None = None) -> None:
        """Forget the failure state and the background builder, and force both devices' kernels on or off
        (``available``; None: as ``QUANTD_COMPILE`` and the toolchain say). One-shot runs turn them off; tests
        force either path."""
        self._broken = None
        self.failed_cuda.clear()
        self._available = available
        self._forced = available
        self._exhausted.clear()
        with self._pending_lock:  # first calls compile in the caller again; queued builds find they are stale
            builder, self._builder = self._builder, None
            self._pending.clear()
        if builder is not None:
            builder.put(None)  # the thread's end


def _held_copy(a: Any) -> Any:
    """A tensor argument for a later build: its own copy (not a view of a caller's buffer), with the dims
    ``mark_static`` marked on it still marked; anything else as it is."""
    if not isinstance(a, torch.Tensor):
        return a
    copy = a.detach().clone()
    for dim in getattr(a, "_dynamo_static_indices", ()):
        torch._dynamo.mark_static(copy, dim)
    return copy


# Variants queued for the background build at most (each holds a copy of its caller's arguments until built).
MAX_PENDING_BUILDS = 8
_BUILDS_ITSELF = threading.local()  # KERNELS.building(): this thread compiles what it meets

KERNELS = _Compiled()

