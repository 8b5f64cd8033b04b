"""Engine, sessions, schema upgrade at start, and the single writer.

SQLite (the default) or PostgreSQL (psycopg 3): pragmas and the WAL checkpointer are SQLite's only;
PostgreSQL gets a connection pool sized for the writer, the request threads and the listener.

SQLite allows one writer at a time. Instead of letting request threads fight over the lock (and
retry on SQLITE_BUSY), every write runs on one dedicated thread (`write`); reads run concurrently on
the pool, which WAL mode allows alongside that writer.

Two lanes, in arrival order within each: small writes (heartbeats, claims, user actions, a few
events: ~1 ms) go before queued bulk ones (big event batches: tens of ms), so a state change or a
live metric never waits behind a backlog of bulk ingest. Callers that must stay ordered await
each write before sending the next (an agent does), so lanes never reorder one caller's writes.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import sqlite3
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from server.dialect import is_postgres, normalize_url

T = TypeVar("T")
STALL_S = 5.0  # a write queued this long means the writer was stalled (heartbeats ~1 ms normally)
MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def make_engine(url: str, busy_timeout_s: float = 30.0) -> Engine:
    url = normalize_url(url)
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": busy_timeout_s},
                               pool_size=8, max_overflow=8)

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
            cur.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints; safe with WAL
            cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
            # No checkpoint inside a commit: at 50k points/s the WAL passes the default 1,000 pages
            # every second or two, and that commit would copy them and fsync (100+ ms on a busy
            # disk) while live frames wait. Database's checkpointer thread does it instead.
            cur.execute("PRAGMA wal_autocheckpoint=0")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()
        return engine
    if is_postgres(url):
        # Reads run on the threadpool (up to ~40 threads); 10 + 10 connections cover a busy server
        # without taking a large share of PostgreSQL's max_connections (100 by default) per process.
        # pre_ping: a connection dropped by a database restart is replaced, not handed out.
        return create_engine(url, pool_size=10, max_overflow=10, pool_pre_ping=True, pool_recycle=1800,
                             connect_args={"connect_timeout": int(busy_timeout_s)})
    return create_engine(url, pool_pre_ping=True)


def alembic_config(url: str):
    from alembic.config import Config
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))  # configparser escapes
    return cfg


def upgrade_to_head(url: str) -> None:
    """Bring the schema to the newest migration; run at every start (a no-op when current)."""
    from alembic import command
    command.upgrade(alembic_config(url), "head")


class Database:
    def __init__(self, url: str, busy_timeout_s: float = 30.0):
        self.url = url = normalize_url(url)
        self.engine = make_engine(url, busy_timeout_s)
        self.dialect = self.engine.dialect.name  # "sqlite" or "postgresql"
        self.Session = sessionmaker(self.engine, expire_on_commit=False)
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self.stalled_at = 0.0  # when a write last ended stalled or failed (see _note_stall)
        self.in_stall = False  # the last write failed in the database (locked, disk full)
        self.outages: dict[str, dict] = {}  # webhook alerts about database trouble, open until it ends
        self.outages_cleared: dict[str, tuple] = {}  # kind -> (its last alert, when it cleared)
        self._order = itertools.count()
        self._writer = threading.Thread(target=self._run, name="db-writer", daemon=True)
        self._writer.start()
        self._stop = threading.Event()
        self._checkpointer = None
        if url.startswith("sqlite") and self.engine.url.database not in (None, "", ":memory:"):
            self._checkpointer = threading.Thread(target=self._checkpoints, name="db-checkpoint", daemon=True)
            self._checkpointer.start()

    def read(self) -> Session:
        return self.Session()

    def queue_depth(self) -> int:
        """Writes waiting for the writer thread (approximate, as any queue size read is)."""
        return self._queue.qsize()

    def submit(self, fn: Callable[[Session], T], bulk: bool = False) -> "concurrent.futures.Future[T]":
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.queued_at = time.time()  # for stall accounting
        self._queue.put((1 if bulk else 0, next(self._order), fn, fut))
        return fut

    async def write(self, fn: Callable[[Session], T], bulk: bool = False) -> T:
        """Run fn(session) on the writer thread inside one transaction, committed when fn returns."""
        return await asyncio.wrap_future(self.submit(fn, bulk))

    def write_sync(self, fn: Callable[[Session], T]) -> T:
        return self.submit(fn).result()

    def _run(self) -> None:
        while True:
            _, _, fn, fut = self._queue.get()
            if fn is None:
                return
            self._execute(fn, fut)

    def _execute(self, fn: Callable, fut: concurrent.futures.Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            with self.Session() as s:  # closing without commit rolls back
                s.info["yield"] = lambda: self._yield(s)
                result = fn(s)
                wrote = self._wrote(s)
                s.commit()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            # raw cursors (heartbeats, ingest) raise the driver's own error, not SQLAlchemy's
            self._note_stall(fut, failed=isinstance(e, (OperationalError, sqlite3.OperationalError)), wrote=False)
            fut.set_exception(e)
        else:
            self._note_stall(fut, failed=False, wrote=wrote)
            fut.set_result(result)

    def _wrote(self, s: Session) -> bool:
        """Whether this transaction took SQLite's write lock (pysqlite begins a transaction at the
        first INSERT/UPDATE/DELETE only): a read-only one goes through another process's lock and
        proves nothing about writing. Always True elsewhere."""
        if self.dialect != "sqlite":
            return True
        if s.get_transaction() is None:
            return False
        try:
            return bool(s.connection().connection.dbapi_connection.in_transaction)
        except AttributeError:
            return True

    def _note_stall(self, fut, failed: bool, wrote: bool = True) -> None:
        """A write that waited past STALL_S (another process's lock, a slow disk) or failed in the
        database (locked past the busy timeout, a full disk) means heartbeats could not be stored
        meanwhile: the reaper counts agents' leases from the end of such a stall. Only a transaction
        that wrote ends a stall: read-only ones (a reaper pass with nothing to do) go through a
        foreign lock, and taking them for the end made the outage clear and reopen every pass."""
        now = time.time()
        if failed:
            self.in_stall, self.stalled_at = True, now
        elif self.in_stall:
            if wrote:
                self.in_stall, self.stalled_at = False, now
        elif now - getattr(fut, "queued_at", now) > STALL_S:
            self.stalled_at = now

    def stall_ended_at(self) -> float:
        """When the latest write stall ended: now while the last write failed (the stall goes on,
        or the write asking is the first through after it), else the end of the latest one (0: never)."""
        return time.time() if self.in_stall else self.stalled_at

    def _yield(self, s: Session) -> None:
        """For a long bulk write, between its chunks (s.info["yield"]()): commit what it has done,
        then run the small writes that queued meanwhile, so they wait for a chunk, not a batch."""
        s.commit()
        s.expire_all()  # what the small writes change (a job's state...) is re-read, not overwritten
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item[0] != 0:
                self._queue.put(item)  # keeps its place: the order number travels with it
                return
            self._execute(item[2], item[3])

    def _checkpoints(self, every_s: float = 0.5) -> None:
        """PASSIVE checkpoints on their own connection and thread: they copy committed WAL pages
        into the database (and fsync) without ever blocking the writer or readers; the WAL then
        restarts from its beginning, so it stays a few MB."""
        import sqlite3
        con = sqlite3.connect(self.engine.url.database, timeout=30, check_same_thread=False)
        try:
            while not self._stop.wait(every_s):
                try:
                    con.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                except sqlite3.Error:
                    pass  # busy or locked: next time
        finally:
            try:
                con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error:
                pass
            con.close()

    def close(self) -> None:
        self._queue.put((2, next(self._order), None, None))  # after everything queued
        self._writer.join()
        self._stop.set()
        if self._checkpointer is not None:
            self._checkpointer.join()
        self.engine.dispose()
