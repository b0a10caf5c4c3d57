"""A ``quantd worker`` process for the many-hosts test: ``python scale_worker.py RUNS_LOG`` with the backends
in ``QUANTD_*`` variables. It runs the real pipeline; inputs named ``slow*`` wait ``QUANTD_TEST_TENSOR_DELAY_S``
after each tensor (so that a SIGKILL lands mid-job), and every pipeline run that finishes appends its job id
to RUNS_LOG (so that the test sees a job that ran to the end twice)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from quantd.io.pipeline import quantize_file
from quantd.jobs import JobsConfig, run_worker
from quantd.server.app import jobs_config
from quantd.server.settings import Settings


def pipeline(src: Path, dst: Path, config: Any, *, device: str, filename: str | None, job_id: str | None,
             on_progress: Any, should_cancel: Any, **extra: Any) -> Any:
    delay = float(os.environ.get("QUANTD_TEST_TENSOR_DELAY_S", "0")) if (filename or "").startswith("slow") else 0.0

    def progress(p: Any) -> None:
        on_progress(p)
        if delay and p.tensors_done:
            time.sleep(delay)

    report = quantize_file(src, dst, config, device=device, filename=filename, job_id=job_id,
                           on_progress=progress, should_cancel=should_cancel, **extra)
    with open(sys.argv[1], "a") as log:  # one short line, O_APPEND: whole lines from every process
        log.write(f"{job_id}\n")
    return report


if __name__ == "__main__":
    base = jobs_config(Settings(), workers=1)
    config = JobsConfig(**{**base.__dict__, "heartbeat_s": base.lease_s / 4, "reap_interval_s": 1.0,
                           "poll_s": 0.05, "device": "cpu"})
    run_worker(config, quantize_fn=pipeline)
