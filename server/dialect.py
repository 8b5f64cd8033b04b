"""What differs between SQLite and PostgreSQL, in one place: URLs, raw cursors, integer width.

The hot paths (ingest, heartbeats, series reads) use the DBAPI cursor of the session's own
connection (same transaction) with `?` placeholders and no per-row SQLAlchemy work. On PostgreSQL
(psycopg 3, `%s` placeholders) `raw_cursor` hands out a thin wrapper that rewrites the placeholders
once per statement text; statements that differ beyond that are spelled per dialect by the caller.
"""
from __future__ import annotations

from functools import lru_cache

from sqlalchemy import Column, Integer
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session


def normalize_url(url: str) -> str:
    """postgres:// and postgresql:// mean psycopg 3 (SQLAlchemy's default driver would be psycopg2)."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


def is_postgres(url: str) -> bool:
    return url.startswith(("postgresql", "postgres:"))


@compiles(Integer, "postgresql")
def _bigint(type_, compiler, **kw) -> str:
    """SQLite integers are 64-bit, and the API accepts steps, seqs and ids up to 2**63 - 1: so are
    our columns on PostgreSQL (DDL only: a cast or bind keeps INTEGER; an autoincrement primary key
    is still SERIAL, ids stay small)."""
    if isinstance(kw.get("type_expression"), Column):
        return "BIGINT"
    return compiler.visit_integer(type_, **kw)


def compare_type(context, inspected_column, metadata_column, inspected_type, metadata_type):
    """For alembic's comparisons (autogenerate, tests): a model Integer is the BIGINT the rule
    above writes on PostgreSQL, not a change. None: alembic's own comparison."""
    if isinstance(metadata_type, Integer) and isinstance(inspected_type, Integer):
        return False
    return None


@lru_cache(maxsize=512)
def pyformat(sql: str) -> str:
    """`?` placeholders -> psycopg's `%s` (our raw SQL has no `?` or `%` in literals)."""
    return sql.replace("?", "%s")


class PgCursor:
    """A psycopg cursor that takes `?` placeholders, like sqlite3's."""
    __slots__ = ("cur",)

    def __init__(self, cur):
        self.cur = cur

    def execute(self, sql: str, params=()):
        self.cur.execute(pyformat(sql), params)
        return self

    def executemany(self, sql: str, rows):
        self.cur.executemany(pyformat(sql), rows)
        return self

    def fetchone(self):
        return self.cur.fetchone()

    def fetchall(self):
        return self.cur.fetchall()

    def __iter__(self):
        return iter(self.cur)

    @property
    def rowcount(self) -> int:
        return self.cur.rowcount


def dialect_name(s: Session) -> str:
    return s.get_bind().dialect.name


def raw_cursor(s: Session):
    """The DBAPI cursor of the session's connection (its transaction), taking `?` placeholders."""
    cur = s.connection().connection.cursor()
    return cur if dialect_name(s) == "sqlite" else PgCursor(cur)
