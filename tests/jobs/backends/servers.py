"""Throwaway real servers for the backend tests and the queue benchmark: a PostgreSQL cluster (Debian's
``postgresql`` binaries, initdb'd in a temp dir) and moto's standalone S3 server. Each start function raises
:class:`Unavailable` with the reason when the server cannot start here; callers skip with it."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class Unavailable(RuntimeError):
    """The server cannot start on this machine (the message says why)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pg_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("pg_ctl")
    if on_path:
        return Path(on_path).parent
    raise Unavailable("PostgreSQL server binaries (pg_ctl, initdb) not found: install Debian's postgresql")


@dataclass
class Postgres:
    root: Path
    port: int
    bin: Path
    as_user: list[str]

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        subprocess.run([*self.as_user, str(self.bin / "pg_ctl"), "-D", str(self.root / "data"), "-m", "immediate",
                        "stop"], capture_output=True, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def postgres(*, fsync: bool = False) -> Iterator[Postgres]:
    """A PostgreSQL cluster on a free 127.0.0.1 port with trust authentication for user ``postgres``; as root
    the server runs as the ``postgres`` system user (it refuses to run as root). ``fsync`` off (tests): commits
    are not flushed to disk, which a throwaway cluster does not need."""
    bin_ = _pg_bin()
    as_user: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="quantd-pg-"))
    if os.geteuid() == 0:
        runuser = shutil.which("runuser")
        if runuser is None:
            raise Unavailable("running as root without runuser: PostgreSQL cannot start as root")
        try:
            import pwd

            pw = pwd.getpwnam("postgres")
        except KeyError:
            raise Unavailable("running as root and there is no 'postgres' user to run the server as") from None
        os.chown(root, pw.pw_uid, pw.pw_gid)
        as_user = [runuser, "-u", "postgres", "--"]
    port = free_port()
    data = root / "data"
    try:
        init = subprocess.run([*as_user, str(bin_ / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust",
                               "-E", "UTF8", "--no-sync"], capture_output=True, text=True, timeout=120)
        if init.returncode != 0:
            raise Unavailable(f"initdb failed: {init.stderr.strip()[-400:]}")
        durability = "" if fsync else " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c max_connections=200{durability}"
        start = subprocess.run([*as_user, str(bin_ / "pg_ctl"), "-D", str(data), "-o", opts, "-l",
                                str(root / "log"), "-w", "-t", "60", "start"], capture_output=True, text=True,
                               timeout=90)
        if start.returncode != 0:
            log = (root / "log").read_text(errors="replace")[-400:] if (root / "log").exists() else ""
            raise Unavailable(f"pg_ctl start failed: {start.stderr.strip()[-300:]} {log}")
    except (OSError, subprocess.TimeoutExpired) as e:
        shutil.rmtree(root, ignore_errors=True)
        raise Unavailable(f"PostgreSQL could not start: {e}") from e
    except Unavailable:
        shutil.rmtree(root, ignore_errors=True)
        raise
    server = Postgres(root, port, bin_, as_user)
    try:
        yield server
    finally:
        server.stop()


@dataclass
class S3Server:
    endpoint: str
    proc: subprocess.Popen[bytes]

    def client(self) -> object:
        from quantd.jobs.backends.s3 import make_client

        return make_client(self.endpoint)

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)  # type: ignore[attr-defined]


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def s3_server() -> Iterator[S3Server]:
    """moto's standalone S3 server (``python -m moto.server``) on a free port; the AWS_* variables of a
    test account are set in this process (and so in the processes it starts)."""
    try:
        import moto.server  # noqa: F401
    except ImportError as e:
        raise Unavailable(f"moto's server is not installed ({e}): pip install 'moto[server]'") from None
    port = free_port()
    env = {**os.environ, **S3_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=2).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise Unavailable(f"moto's S3 server did not start on port {port}") from None
            time.sleep(0.2)
    os.environ.update(S3_ENV)
    try:
        yield S3Server(endpoint, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
