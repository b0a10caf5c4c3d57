"""Each process's scratch folder under ``data_dir/tmp``, and the removal of those whose process has died.

A server streams uploads into scratch and a worker writes its artifact and stages its inputs there; a process
killed (``kill -9``, the OOM killer) leaves them behind, up to twice a model's size per job. Each process
therefore writes under ``tmp/p-<host>-<id>/`` and holds an exclusive ``flock`` on ``tmp/p-<host>-<id>.lock``
(beside the folder, which holds only the scratch files) for its lifetime: the kernel drops the lock when the
process ends however it ends, so any process of the same host sharing the data dir (another replica or
worker, or this one after a restart) can tell a dead owner's folder from a live one by trying the lock, and
removes it at once instead of after the 24-hour sweep of loose files.

``<host>`` is the running kernel's boot id: ``flock`` is reliable among the processes of one kernel (a
network filesystem may keep locks per host), so a process judges only its own host's folders by their
locks; another host's folder goes only once it has not been touched for a day (each process touches its own
at every sweep). Where ``flock`` does not work, a process writes into ``tmp/`` itself, swept by age only.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import socket
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
# Per tmp root: this process's folder and the descriptor of its held lock (None: no flock, the root itself).
_mine: dict[Path, tuple[Path, int | None]] = {}


def _host_id() -> str:
    """8 hex digits naming this kernel: its boot id (shared by the containers of one host), else the host name."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = socket.gethostname()
    return hashlib.sha256(boot.encode()).hexdigest()[:8]


HOST = _host_id()


def _lock_of(folder: Path) -> Path:
    return folder.with_name(folder.name + LOCK)


def process_dir(tmp_root: Path) -> Path:
    """This process's scratch folder under ``tmp_root`` (made and locked on first use; the same for every
    caller in the process; made again if something removed it)."""
    root = Path(tmp_root).resolve()
    with _lock:
        if root in _mine:
            folder, fd = _mine[root]
            if not _gone(folder):
                return folder
            if fd is not None:  # our folder was removed under us: its lock goes with it
                _drop_lock(folder, fd)
        root.mkdir(parents=True, exist_ok=True)
        _mine[root] = (_lock_new(root) if fcntl is not None else None) or (root, None)
        return _mine[root][0]


def _gone(folder: Path) -> bool:
    """Whether ``folder`` no longer exists (an error other than that, ESTALE say, is not taken for gone)."""
    try:
        os.stat(folder)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def _drop_lock(folder: Path, fd: int) -> None:
    with contextlib.suppress(OSError):
        _lock_of(folder).unlink()
    os.close(fd)


def _lock_new(root: Path) -> tuple[Path, int] | None:
    """A new folder under ``root`` and the descriptor of its held lock, or None where ``flock`` does not
    work there."""
    for _ in range(5):
        folder = root / f"{PREFIX}{HOST}-{uuid.uuid4().hex[:16]}"
        lock = _lock_of(folder)
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # A sweeper may have taken an unlocked lock file for an orphan and unlinked it in between: then
            # the lock held is on a file no longer there, and a new name is tried.
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        except OSError as e:  # ENOLCK, EOPNOTSUPP: no flock on this filesystem
            _drop_lock(folder, fd)
            log.warning("no flock in %s (%s): scratch files are swept by age only", root, e)
            return None
        if not same:
            os.close(fd)
            continue
        try:
            folder.mkdir()
        except OSError:
            os.close(fd)
            raise
        return folder, fd
    raise OSError(f"could not lock a scratch folder in {root}")


def release(tmp_root: Path) -> None:
    """At a clean stop: this process's folder and lock removed if the folder is empty (what is left in it
    stays for the next start's sweep)."""
    root = Path(tmp_root).resolve()
    with _lock:
        folder, fd = _mine.get(root, (root, None))
        if fd is None:
            return
        try:
            folder.rmdir()
        except OSError:  # not empty, or gone
            return
        del _mine[root]
        _drop_lock(folder, fd)


def owned_by_this_process(folder: Path) -> bool:
    return any(Path(folder).resolve() == mine for mine, _ in _mine.values())


def is_process_entry(path: Path) -> bool:
    """Whether ``path`` (an entry of ``tmp/``) is a process's scratch folder or its lock file."""
    return path.name.startswith(PREFIX)


def glob_all(tmp_root: Path, pattern: str) -> list[Path]:
    """The files matching ``pattern`` in every process's scratch folder under ``tmp_root``, and loose in it."""
    root = Path(tmp_root)
    return [*root.glob(pattern), *root.glob(f"{PREFIX}*/{pattern}")]


def _this_host(name: str) -> bool:
    return name.startswith(f"{PREFIX}{HOST}-")


def _open_lock(lock: Path) -> int | None:
    """A descriptor of ``lock`` to try: read-write (NFS takes flock as a POSIX lock, which an exclusive lock
    needs a writable descriptor for), else read-only (another user's file: a local flock needs no write
    access); None when it cannot be opened."""
    for flags in (os.O_RDWR, os.O_RDONLY):
        try:
            return os.open(lock, flags)
        except (PermissionError, IsADirectoryError):
            continue
        except OSError:
            return None
    return None


def _remove(folder: Path | None, lock: Path) -> None:
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):  # gone already, or another user's to remove
        lock.unlink()


def _remove_if_dead(lock: Path, folder: Path | None) -> bool | None:
    """Lock ``lock`` if its owner has ended and, holding it, remove ``folder`` (if any) and ``lock``: True;
    False: a live process holds it; None: cannot tell (gone, not ours to open, no lock to take there)."""
    fd = _open_lock(lock)
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    except OSError:
        os.close(fd)
        return None
    try:  # removed while the lock is held: no process can take this name's lock meanwhile
        _remove(folder, lock)
    finally:
        os.close(fd)
    return True


def touch_mine(tmp_root: Path) -> None:
    """Mark this process's folder as alive for the other hosts' age sweep."""
    folder, fd = _mine.get(Path(tmp_root).resolve(), (Path(tmp_root), None))
    if fd is not None:
        with contextlib.suppress(OSError):
            os.utime(folder)


def remove_dead(tmp_root: Path, *, older_than_s: float | None = None) -> int:
    """Remove the scratch folders under ``tmp_root`` whose owner has ended: this host's by their locks,
    other hosts' once untouched for ``older_than_s`` (None: left alone). Returns how many."""
    if fcntl is None:
        return 0
    removed = 0
    root = Path(tmp_root)
    now = time.time()
    for entry in root.glob(f"{PREFIX}*"):
        try:
            age = now - entry.stat().st_mtime
        except FileNotFoundError:
            continue
        if entry.name.endswith(LOCK):
            # a lock whose folder never came (its process died in between) or is gone
            if not (root / entry.name[:-len(LOCK)]).exists() and age > _YOUNG_S:
                _remove_if_dead(entry, None)
            continue
        if not entry.is_dir() or owned_by_this_process(entry):
            continue
        lock = _lock_of(entry)
        limit = older_than_s  # another host's folder: by age only
        if _this_host(entry.name):
            dead = _remove_if_dead(lock, entry)
            if dead is not None:
                removed += dead
                continue
            # no lock to try: a sweeper is removing it (no lock file), or locks fail here; by age, then
            limit = _YOUNG_S if not lock.exists() else older_than_s
        if limit is not None and age > limit:
            _remove(entry, lock)
            removed += 1
    if removed:
        log.info("removed the scratch folders of %d ended process(es)", removed, extra={"tmp": str(tmp_root)})
    return removed
