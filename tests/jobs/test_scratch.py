"""Scratch folders per process: a killed process's folder is removed by the next process that looks, a live
one's never, and the age sweep leaves every process's folder to the owner check."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantd.jobs import LocalStorage, scratch

pytestmark = pytest.mark.skipif(scratch.fcntl is None, reason="no flock on this platform")

_CHILD = """
import sys, time
from pathlib import Path
from quantd.jobs.scratch import process_dir
d = process_dir(Path(sys.argv[1]))
(d / "upload-half-written").write_bytes(b"x" * 4096)
print(d, flush=True)
time.sleep(600)
"""


def _child(tmp_root: Path) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_root)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def test_a_killed_process_scratch_is_removed_and_a_live_one_kept(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "data")
    storage.init()
    live, live_dir = _child(storage.tmp_root)
    dead, dead_dir = _child(storage.tmp_root)
    try:
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait(timeout=30)
        dead.stdout.close()  # type: ignore[union-attr]
        assert (dead_dir / "upload-half-written").exists()
        mine = storage.tmp
        (mine / "artifact-x.part").write_bytes(b"y")
        storage.init()  # a restart on the same data dir: the dead process's folder goes at once
        assert not dead_dir.exists()
        assert (live_dir / "upload-half-written").exists() and (mine / "artifact-x.part").exists()
        old = time.time() - 3 * 86400  # an idle process's folder looks old: the age sweep must not take it
        for path in (live_dir, live_dir / "upload-half-written", mine):
            os.utime(path, (old, old))
        storage.sweep_tmp(86400.0)
        assert (live_dir / "upload-half-written").exists() and mine.is_dir()
    finally:
        for proc in (live, dead):
            proc.kill()
            proc.wait(timeout=30)
            proc.stdout.close()  # type: ignore[union-attr]
    assert storage.sweep_tmp(86400.0) >= 1 and not live_dir.exists()
    assert scratch.process_dir(storage.tmp_root) == mine  # one folder per process, kept
