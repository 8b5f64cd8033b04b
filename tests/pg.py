"""A real PostgreSQL for the test run: Debian's postgresql package (initdb in a temporary directory,
a free port on 127.0.0.1, removed at exit), so CI needs nothing set up by hand.

initdb refuses to run as root: as root the cluster runs as the `postgres` user the Debian package
creates (or `nobody`), dropping root in the child process. Durability is off (fsync,
synchronous_commit): a test cluster that dies with the machine is thrown away anyway.
"""
from __future__ import annotations

import atexit
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional


def bin_dir() -> Optional[Path]:
    """The newest /usr/lib/postgresql/<version>/bin that has initdb and postgres."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0)
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresCluster:
    """One postgres server process; databases are created per test server (create_database)."""

    def __init__(self):
        self.bin = bin_dir()
        if self.bin is None:
            raise RuntimeError("PostgreSQL is not installed (Debian: apt-get install postgresql; `make setup-pg`)")
        self.user = None  # run as this OS user (when we are root)
        if os.geteuid() == 0:
            for name in ("postgres", "nobody"):
                try:
                    pwd.getpwnam(name)
                    self.user = name
                    break
                except KeyError:
                    continue
        self.dir = Path(tempfile.mkdtemp(prefix="tokenpulse-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.proc: Optional[subprocess.Popen] = None

    def _as_user(self) -> dict:
        """Popen arguments that drop root to the cluster's user in the child (no runuser between us
        and postgres, so our signals reach postgres itself)."""
        if not self.user:
            return {}
        pw = pwd.getpwnam(self.user)
        return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": [],
                "env": {**os.environ, "HOME": str(self.dir), "USER": self.user, "LOGNAME": self.user}}

    def start(self) -> "PostgresCluster":
        os.chmod(self.dir, 0o700)
        if self.user:
            pw = pwd.getpwnam(self.user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        r = subprocess.run([str(self.bin / "initdb"), "-D", str(self.data), "-U", "tokenpulse", "-A", "trust",
                            "-E", "UTF8", "--locale=C", "--no-sync"], capture_output=True, text=True,
                           cwd=self.dir, **self._as_user())
        if r.returncode != 0:
            raise RuntimeError(f"initdb failed: {r.stderr[-2000:]}")
        log = open(self.dir / "postgres.log", "ab")
        self.proc = subprocess.Popen([
            str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port), "-k", str(self.dir),
            "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "synchronous_commit=off",
            "-c", "full_page_writes=off", "-c", "max_connections=500", "-c", "shared_buffers=64MB"],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.dir, start_new_session=True, **self._as_user())
        atexit.register(self.stop)
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited: {(self.dir / 'postgres.log').read_text()[-2000:]}")
            try:
                self.execute("SELECT 1")
                return self
            except Exception:  # not accepting connections yet
                time.sleep(0.1)
        raise RuntimeError("postgres did not start in 60 s")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://tokenpulse@127.0.0.1:{self.port}/{database}"

    def execute(self, sql: str) -> None:
        import psycopg
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=tokenpulse dbname=postgres",
                             autocommit=True, connect_timeout=5) as con:
            con.execute(sql)

    def create_database(self, prefix: str = "t") -> str:
        """A new empty database; returns its SQLAlchemy URL."""
        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        self.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # "fast" shutdown: disconnect clients, stop
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_cluster: Optional[PostgresCluster] = None


def cluster() -> PostgresCluster:
    """The test run's cluster, started at first use and stopped at exit."""
    global _cluster
    if _cluster is None:
        _cluster = PostgresCluster().start()
    return _cluster


def enabled() -> bool:
    """TOKENPULSE_TEST_DB=postgresql runs the servers the tests start on PostgreSQL."""
    return os.environ.get("TOKENPULSE_TEST_DB", "sqlite").lower() in ("postgresql", "postgres", "pg")


def database_url(tmp_path: Path, name: str = "db") -> str:
    """A new empty database for one test: a SQLite file in tmp_path, or (TOKENPULSE_TEST_DB=postgresql)
    a new database on the run's PostgreSQL."""
    if enabled():
        return cluster().create_database(name)
    return f"sqlite:///{tmp_path / (name + '.sqlite')}"


def is_postgres(url: str) -> bool:
    return url.startswith(("postgresql", "postgres:"))


def connect(url: str):
    """A DBAPI connection to a test database (sqlite3 or psycopg), as a context manager that closes it."""
    import contextlib
    if is_postgres(url):
        import psycopg
        from sqlalchemy.engine import make_url
        u = make_url(url)
        return contextlib.closing(psycopg.connect(host=u.host, port=u.port, user=u.username, dbname=u.database))
    import sqlite3
    return contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"), timeout=30))
