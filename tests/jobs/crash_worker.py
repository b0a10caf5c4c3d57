"""A worker process for the crash test: ``python crash_worker.py DATA_DIR LEASE_S``.

Its pipeline writes a partial artifact and then holds the job until cancelled, so the test can
SIGKILL the process while the job is running."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quantd.errors import JobCancelled
from quantd.jobs import JobsConfig, run_worker


def hold(src: Path, dst: Path, config: Any, *, device: str, filename: str | None, job_id: str | None,
         on_progress: Callable[..., None] | None, should_cancel: Callable[[], bool] | None) -> Any:
    Path(dst).write_bytes(b"partial artifact")
    idle = threading.Event()
    while should_cancel is None or not should_cancel():
        idle.wait(0.05)
    raise JobCancelled("stopped")


if __name__ == "__main__":
    lease_s = float(sys.argv[2])
    run_worker(JobsConfig(data_dir=Path(sys.argv[1]), device="cpu", workers=1, lease_s=lease_s,
                          heartbeat_s=lease_s / 4, poll_s=0.05), quantize_fn=hold)
