"""Helpers of the jobs tests: polling with a deadline, uploads as the server makes them, a gated pipeline."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from quantd.errors import JobCancelled
from quantd.io.files import sha256_file
from quantd.jobs import JobService, StoredUpload
from quantd_client import Progress, QuantConfig, Report, Scheme, Summary, TensorReport

CONFIG = QuantConfig(scheme=Scheme(dtype="int4", group_size=32))


def wait_for(pred: Callable[[], Any], *, timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll ``pred`` until truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def make_upload(svc: JobService, src: Path, *, filename: str = "model.safetensors") -> StoredUpload:
    """What the server does: stream the upload into the data dir's tmp, then describe it."""
    dst = svc.new_upload_path(".safetensors")
    shutil.copyfile(src, dst)
    return StoredUpload(path=dst, filename=filename, bytes=dst.stat().st_size, sha256=sha256_file(dst),
                        format="safetensors", tensors=3)


def cast_pipeline(src: Path, dst: Path, config: QuantConfig, *, device: str, filename: str | None = None,
                  job_id: str | None = None, on_progress: Callable[[Progress], None] | None = None,
                  should_cancel: Callable[[], bool] | None = None) -> Report:
    """A stand-in for quantd.io.quantize_file that tests the job layer alone: every tensor cast to
    float16, one at a time, with progress and cancellation between tensors like the real one."""
    tensors = load_file(str(src), device=device)
    names = sorted(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    out: dict[str, torch.Tensor] = {}
    done = 0
    if on_progress is not None:
        on_progress(Progress(tensors_total=len(names), bytes_total=total))
    for name in names:
        if should_cancel is not None and should_cancel():
            raise JobCancelled(f"cancelled after {len(out)} of {len(names)} tensors")
        out[name] = tensors[name].to(torch.float16)
        done += tensors[name].numel() * tensors[name].element_size()
        if on_progress is not None:
            on_progress(Progress(tensors_done=len(out), tensors_total=len(names), bytes_done=done,
                                 bytes_total=total, fraction=done / total))
    save_file(out, str(dst))
    out_bytes = sum(t.numel() * 2 for t in out.values())
    summary = Summary(tensors_quantized=len(names), tensors_skipped=0, input_bytes=total, output_bytes=out_bytes,
                      compression_ratio=total / out_bytes, bits_per_weight=16.0, mean_sqnr_db=None,
                      min_sqnr_db=None, worst_tensor=None, elapsed_s=0.0, device=device)
    reports = [TensorReport(name=n, shape=list(tensors[n].shape), in_dtype="F32", scheme=None, stats=None,
                            skipped=False, reason="float16 cast (test pipeline)") for n in names]
    return Report(job_id=job_id, config=config, summary=summary, tensors=reports)


class GatedPipeline:
    """A pipeline held at its start until ``release`` is set (or cancelled meanwhile)."""

    def __init__(self, inner: Callable[..., Report] = cast_pipeline) -> None:
        self.inner = inner
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, src: Path, dst: Path, config: QuantConfig, *, device: str, filename: str | None,
                 job_id: str | None, on_progress: Callable[[Progress], None] | None,
                 should_cancel: Callable[[], bool] | None) -> Report:
        assert on_progress is not None and should_cancel is not None
        on_progress(Progress(tensors_done=0, tensors_total=3))
        self.started.set()
        while not self.release.wait(0.01):
            if should_cancel():
                raise JobCancelled("cancelled while gated")
        return self.inner(src, dst, config, device=device, filename=filename, job_id=job_id,
                             on_progress=on_progress, should_cancel=should_cancel)


