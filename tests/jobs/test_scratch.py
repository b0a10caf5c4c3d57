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


def test_other_hosts_folders_go_by_age_and_orphan_locks_by_age_and_lock(tmp_path: Path) -> None:
    """flock is trusted among one kernel's processes only; a lock file with no folder yet may be a process
    between creating and locking it."""
    root = tmp_path / "tmp"
    root.mkdir()
    other_old, other_new = root / "p-00000000-aaaa", root / "p-00000000-bbbb"
    for folder in (other_old, other_new):
        folder.mkdir()
        (folder / "part").write_bytes(b"x")
    day_ago = time.time() - 2 * 86400
    os.utime(other_old, (day_ago, day_ago))
    young_orphan, old_orphan = root / f"p-{scratch.HOST}-cccc.lock", root / f"p-{scratch.HOST}-dddd.lock"
    young_orphan.touch()
    old_orphan.touch()
    os.utime(old_orphan, (day_ago, day_ago))
    assert scratch.remove_dead(root) == 0 and other_old.exists()  # no age given: other hosts' stay
    assert scratch.remove_dead(root, older_than_s=86400) == 1
    assert not other_old.exists() and other_new.exists()
    assert young_orphan.exists() and not old_orphan.exists()


def test_without_flock_the_scratch_is_the_shared_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(scratch.fcntl, "flock", no_flock)
    root = tmp_path / "nfs-tmp"
    assert scratch.process_dir(root) == root.resolve()
    assert list(root.iterdir()) == []  # no lock file left behind


def test_a_folder_removed_under_the_process_is_made_again_and_the_old_lock_released(tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "tmp"
    first = scratch.process_dir(root)
    shutil.rmtree(first)
    second = scratch.process_dir(root)
    assert second != first and second.is_dir()
    assert sorted(p.name for p in root.iterdir()) == sorted([second.name, f"{second.name}.lock"])


def test_a_clean_stop_removes_its_empty_folder_and_keeps_a_busy_one(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "data")
    storage.init()
    folder = storage.tmp
    storage.release_scratch()
    assert list(storage.tmp_root.iterdir()) == []  # folder and lock gone
    busy = storage.tmp  # a new one, on first use
    assert busy != folder
    (busy / "upload-x").write_bytes(b"x")
    storage.release_scratch()
    assert (busy / "upload-x").exists()
