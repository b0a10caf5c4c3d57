"""A worker process for the directory crash test: ``python crash_dir_worker.py DATA_DIR LEASE_S``.

Its directory pipeline writes a partial output and then holds the job until cancelled, so the test can
SIGKILL the process while a model directory job is running."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import quantd.io.model_dir as model_dir
from quantd.errors import JobCancelled
from quantd.jobs import JobsConfig, run_worker


def hold(files: Any, dst: Any, config: Any, *, should_cancel: Any = None, **_: Any) -> Any:
    Path(dst).mkdir(parents=True)
    (Path(dst) / "partial.safetensors").write_bytes(b"partial output")
    idle = threading.Event()
    while should_cancel is None or not should_cancel():
        idle.wait(0.05)
    raise JobCancelled("stopped")


if __name__ == "__main__":
    model_dir.quantize_directory = hold
    lease_s = float(sys.argv[2])
    run_worker(JobsConfig(data_dir=Path(sys.argv[1]), device="cpu", workers=1, lease_s=lease_s,
                          heartbeat_s=lease_s / 4, poll_s=0.05))
