"""Engine, sessions, schema upgrade at start, and the single writer.

SQLite allows one writer at a time. Instead of letting request threads fight over the lock (and
retry on SQLITE_BUSY), every write runs on one dedicated thread (`write`), in order; reads run
concurrently on the pool, which WAL mode allows alongside that writer.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from typing import Callable, TypeVar

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

T = TypeVar("T")
MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30},
                               pool_size=8, max_overflow=8)

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
            cur.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints; safe with WAL
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()
        return engine
    return create_engine(url, pool_pre_ping=True)


def alembic_config(url: str):
    from alembic.config import Config
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url)
    return cfg


def upgrade_to_head(url: str) -> None:
    """Bring the schema to the newest migration; run at every start (a no-op when current)."""
    from alembic import command
    command.upgrade(alembic_config(url), "head")


class Database:
    def __init__(self, url: str):
        self.url = url
        self.engine = make_engine(url)
        self.Session = sessionmaker(self.engine, expire_on_commit=False)
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="db-writer")

    def read(self) -> Session:
        return self.Session()

    async def write(self, fn: Callable[[Session], T]) -> T:
        """Run fn(session) on the writer thread inside one transaction, committed when fn returns."""
        def run() -> T:
            with self.Session() as s, s.begin():
                return fn(s)
        return await asyncio.get_running_loop().run_in_executor(self._writer, run)

    def write_sync(self, fn: Callable[[Session], T]) -> T:
        def run() -> T:
            with self.Session() as s, s.begin():
                return fn(s)
        return self._writer.submit(run).result()

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self.engine.dispose()
