"""Each process's scratch folder under ``data_dir/tmp``, and the removal of those whose process has died.

A server streams uploads into scratch and a worker writes its artifact and stages its inputs there; a process
killed (``kill -9``, the OOM killer) leaves them behind, up to twice a model's size per job. Each process
therefore writes under ``tmp/p-<id>/`` and holds an exclusive ``flock`` on ``tmp/p-<id>.lock`` (beside the
folder, which holds only the scratch files) for its lifetime: the kernel drops the lock when the process ends however it ends, so any process sharing the data
dir (another replica or worker on the host, or this one after a restart) can tell a dead owner's folder from
a live one by trying the lock, and removes it at once instead of after the 24-hour sweep of loose files.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from pathlib import Path

try:
    import fcntl
except ImportError:  # no flock (not a POSIX system): one shared folder, swept by age only
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("quantd.jobs")

PREFIX = "p-"
LOCK = ".lock"
# A folder whose lock file is gone (a sweeper is removing it) is left to that sweeper this long.
_YOUNG_S = 60.0

_lock = threading.Lock()
_mine: dict[Path, Path] = {}
_held: list[int] = []  # the owner files' descriptors: open, and so locked, until the process ends


def process_dir(tmp_root: Path) -> Path:
    """This process's scratch folder under ``tmp_root`` (made and locked on first use; the same for every
    caller in the process)."""
    root = Path(tmp_root).resolve()
    with _lock:
        if root in _mine and _mine[root].is_dir():
            return _mine[root]
        if fcntl is None:
            root.mkdir(parents=True, exist_ok=True)
            _mine[root] = root
            return root
        name = f"{PREFIX}{uuid.uuid4().hex[:16]}"
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / f"{name}{LOCK}", os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # before the folder exists: no sweeper sees it unlocked
        _held.append(fd)
        folder = root / name
        folder.mkdir()
        _mine[root] = folder
        return folder


def owned_by_this_process(folder: Path) -> bool:
    return Path(folder).resolve() in _mine.values()


def is_process_entry(path: Path) -> bool:
    """Whether ``path`` (an entry of ``tmp/``) is a process's scratch folder or its lock file."""
    return path.name.startswith(PREFIX)


def remove_dead(tmp_root: Path) -> int:
    """Remove the scratch folders under ``tmp_root`` whose owner has ended; returns how many."""
    if fcntl is None:
        return 0
    removed = 0
    root = Path(tmp_root)
    for folder in root.glob(f"{PREFIX}*"):
        if folder.suffix == LOCK or not folder.is_dir() or owned_by_this_process(folder):
            continue
        lock = root / f"{folder.name}{LOCK}"
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:  # its lock is gone: a sweeper took it and is removing the folder
            try:
                stale = time.time() - folder.stat().st_mtime > _YOUNG_S
            except FileNotFoundError:
                continue
            if stale:
                shutil.rmtree(folder, ignore_errors=True)
                removed += 1
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its process lives
        else:
            shutil.rmtree(folder, ignore_errors=True)
            lock.unlink(missing_ok=True)
            removed += 1
        finally:
            os.close(fd)
    for lock in root.glob(f"{PREFIX}*{LOCK}"):  # a lock whose folder never came or was removed
        if not (root / lock.name[:-len(LOCK)]).exists():
            try:
                fd = os.open(lock, os.O_RDWR)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                lock.unlink(missing_ok=True)
            except BlockingIOError:
                pass
            finally:
                os.close(fd)
    if removed:
        log.info("removed the scratch folders of %d ended process(es)", removed, extra={"tmp": str(tmp_root)})
    return removed
