"""Metric points -> the lean metrics table (one row per job, key, attempt, step) plus a rollup row per
256 steps keeping the first, last, min and max point, so a chart of a million points reads a few
thousand rows (server/series.py). Every point belongs to the attempt that logged it: a later attempt
repeating a step (a fresh start after a fix, a resume before the last logged step) stores its own.

A NaN or +-inf point is stored too: +-inf as itself; NaN as itself on PostgreSQL and, on SQLite (which
turns a NaN REAL into NULL, and the column is NOT NULL), as the text 'nan', which a REAL column keeps as
text. A bucket holding one is marked by a negative n (-count) and keeps the min and max of its finite
points, so a NaN never poisons a chart's extremes and the read finds where it happened (server/series.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from operator import itemgetter
from typing import Optional, Sequence

from sqlalchemy import insert, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from server.dialect import dialect_name, raw_cursor
from server.models import MetricKey

ROLLUP_SHIFT = 8  # a rollup row covers 2**8 = 256 steps of one (job, key, attempt)


@dataclass(slots=True)
class Rollup:
    """One (job, key, attempt, 256-step bucket)'s aggregate: how many points, and its first, last, lowest and
    highest point, each a step, t and value. The fields are metric_rollups' columns in their stored
    order (ROLLUP_COLS). Mutable: ingest updates one per point while a batch goes by."""
    n: int
    first_step: int
    first_t: float
    first_value: float
    last_step: int
    last_t: float
    last_value: float
    min_step: int
    min_t: float
    min_value: float
    max_step: int
    max_t: float
    max_value: float

    @classmethod
    def of_points(cls, pts: Sequence[tuple]) -> "Rollup":
        """(step, t, value) rows in step order. Extremes of the finite points; n < 0: some are not."""
        fin = [p for p in pts if is_finite(p[2])]
        if len(fin) == len(pts):
            return cls(len(pts), *pts[0], *pts[-1], *min(pts, key=_value), *max(pts, key=_value))
        low, high = (min(fin, key=_value), max(fin, key=_value)) if fin else (pts[0], pts[0])
        return cls(-len(pts), *pts[0], *pts[-1], *low, *high)

    def row(self) -> tuple:
        """The stored columns, in ROLLUP_COLS order."""
        return (self.n, self.first_step, self.first_t, self.first_value, self.last_step, self.last_t,
                self.last_value, self.min_step, self.min_t, self.min_value, self.max_step, self.max_t,
                self.max_value)

    # each point as (step, t, value), the shape of a metrics row
    @property
    def first(self) -> tuple:
        return (self.first_step, self.first_t, self.first_value)

    @property
    def last(self) -> tuple:
        return (self.last_step, self.last_t, self.last_value)

    @property
    def low(self) -> tuple:
        return (self.min_step, self.min_t, self.min_value)

    @property
    def high(self) -> tuple:
        return (self.max_step, self.max_t, self.max_value)

    def followed_by(self, newer: "Rollup") -> "Rollup":
        """This bucket's points and then `newer`'s, all of whose steps come after these: first stays,
        last is the newer one's, extremes compare (a tie keeps the earlier point)."""
        low = self if self.min_value <= newer.min_value else newer
        high = self if self.max_value >= newer.max_value else newer
        return Rollup(self.n + newer.n, *self.first, *newer.last, *low.low, *high.high)


_value = itemgetter(2)


def is_finite(v) -> bool:
    """A stored value is a finite number (not SQLite's 'nan' text, a NaN or an inf)."""
    return type(v) is not str and v - v == 0
ROLLUP_COLS = ", ".join(f.name for f in fields(Rollup))


class MetricKeys:
    """name -> id, cached: key names are few, points are many."""

    def __init__(self):
        self.ids: dict[str, int] = {}

    def id_for(self, s: Session, name: str) -> int:
        kid = self.ids.get(name)
        if kid is None:
            kid = s.scalar(select(MetricKey.id).where(MetricKey.name == name))
            if kid is None and dialect_name(s) == "postgresql":
                # another server process may add the same name at this moment: keep whichever won
                s.execute(pg_insert(MetricKey).values(name=name).on_conflict_do_nothing(index_elements=["name"]))
                kid = s.scalar(select(MetricKey.id).where(MetricKey.name == name))
            elif kid is None:
                kid = s.execute(insert(MetricKey).values(name=name).returning(MetricKey.id)).scalar_one()
            self.ids[name] = kid
        return kid

    def names(self, s: Session) -> dict[int, str]:
        return {kid: name for kid, name in s.execute(select(MetricKey.id, MetricKey.name))}


METRIC_KEYS = MetricKeys()

INSERT_METRIC = "INSERT OR REPLACE INTO metrics (job_id, key_id, attempt, step, t, value) VALUES "
ROW = "(?, ?, ?, ?, ?, ?)"
ROWS_PER_INSERT = 500  # 3,000 parameters a statement; SQLite allows 32,766
INSERT_ROWS = INSERT_METRIC + ", ".join([ROW] * ROWS_PER_INSERT)
INSERT_ROLLUP = (f"INSERT OR REPLACE INTO metric_rollups (job_id, key_id, attempt, bucket, {ROLLUP_COLS}) "
                 f"VALUES ({', '.join('?' * 17)})")
# PostgreSQL spells upserts ON CONFLICT (placeholders are rewritten by dialect.raw_cursor).
PG_METRIC_CONFLICT = (" ON CONFLICT (job_id, key_id, attempt, step) DO UPDATE SET t = EXCLUDED.t, "
                      "value = EXCLUDED.value")
# One statement and six array parameters for any number of rows: psycopg parses a query's
# placeholders anew when the query is long (not cached), which for 500-row VALUES was most of the
# ingest's CPU on PostgreSQL.
PG_INSERT_ARRAYS = ("INSERT INTO metrics (job_id, key_id, attempt, step, t, value) SELECT * FROM "
                    "unnest(?::bigint[], ?::bigint[], ?::bigint[], ?::bigint[], ?::float8[], ?::float8[])"
                    + PG_METRIC_CONFLICT)
PG_INSERT_ROLLUP = (INSERT_ROLLUP.replace(" OR REPLACE", "") + " ON CONFLICT (job_id, key_id, attempt, bucket) "
                    "DO UPDATE SET "
                    + ", ".join(f"{c} = EXCLUDED.{c}" for c in ROLLUP_COLS.split(", ")))


class PointBatch:
    """The metric rows of one chunk, and each touched bucket's aggregate, kept while they go by."""
    __slots__ = ("rows", "rollups", "dirty", "nonfinite")

    def __init__(self):
        self.rows: list[tuple] = []
        self.rollups: dict[tuple, Rollup] = {}  # (job, key, attempt, bucket) -> this batch's points' aggregate
        self.dirty: set[tuple] = set()  # buckets with a repeated or out-of-order step: recomputed from rows
        self.nonfinite = False  # a NaN/inf point among the rows

    def add(self, s: Session, job_id: int, attempt: int, step: int, t: float, values: dict) -> bool:
        """Whether a value was NaN/inf (the live frames then carry its word: orjson would say null)."""
        key_ids, rows, rollups = METRIC_KEYS.ids, self.rows, self.rollups
        bucket = step >> ROLLUP_SHIFT
        nonfinite = False
        for name, v in values.items():
            kid = key_ids.get(name) or METRIC_KEYS.id_for(s, name)
            rows.append((job_id, kid, attempt, step, t, v))
            if not math.isfinite(v):  # rare: its bucket is recomputed from its rows (Rollup.of_points)
                self.nonfinite = nonfinite = True
                self.dirty.add((job_id, kid, attempt, bucket))
            # The rollup of this bucket, kept while the rows go by (one dict hit a point).
            g = rollups.get((job_id, kid, attempt, bucket))
            if g is None:
                rollups[(job_id, kid, attempt, bucket)] = Rollup(1, step, t, v, step, t, v, step, t, v, step, t, v)
                continue
            g.n += 1
            if step > g.last_step:
                g.last_step, g.last_t, g.last_value = step, t, v
            else:
                self.dirty.add((job_id, kid, attempt, bucket))
            if v < g.min_value:
                g.min_step, g.min_t, g.min_value = step, t, v
            if v > g.max_value:
                g.max_step, g.max_t, g.max_value = step, t, v
        return nonfinite

    def store(self, s: Session) -> None:
        if not self.rows:
            return
        # Raw DBAPI cursor (same connection, so the same transaction): no ORM object or SQLAlchemy
        # statement handling per row. 500 rows per INSERT statement: measured 1.5x executemany's
        # rate, as SQLite runs one statement per 500 rows and Python drops and retakes the GIL once
        # per statement rather than once per row (which also lets the event loop cut in less often).
        cur = raw_cursor(s)
        rows = self.rows
        pg = dialect_name(s) == "postgresql"
        if pg:
            # One statement may not upsert a row twice on PostgreSQL: the last value of a repeated
            # (job, key, attempt, step) wins, as SQLite's REPLACE in order would.
            rows = list({r[:4]: r for r in rows}.values())
            jobs, keys, attempts, steps, ts, values = zip(*rows)
            cur.execute(PG_INSERT_ARRAYS, [pg_array(jobs, int), pg_array(keys, int), pg_array(attempts, int),
                                           pg_array(steps, int), pg_array(ts, float), pg_array(values, float)])
            store_rollups(cur, self.rollups, self.dirty, PG_INSERT_ROLLUP)
            return
        if self.nonfinite:  # SQLite stores a NaN REAL as NULL: the text 'nan' instead (see the top)
            rows = [r if r[5] == r[5] else (*r[:5], "nan") for r in rows]
        full = len(rows) - len(rows) % ROWS_PER_INSERT
        for i in range(0, full, ROWS_PER_INSERT):
            cur.execute(INSERT_ROWS, [x for row in rows[i:i + ROWS_PER_INSERT] for x in row])
        if full < len(rows):
            cur.executemany(INSERT_METRIC + ROW, rows[full:])
        store_rollups(cur, self.rollups, self.dirty)


def pg_array(col, kind) -> str:
    """An array literal ('{1,2,3}') built in one join: psycopg's list adapter dumps element by element
    in Python, which cost more than the insert itself. repr() of a float reads back exactly."""
    return "{" + ",".join(map(repr, map(kind, col))) + "}"


def store_rollups(cur, batch: dict[tuple, Rollup], dirty: set[tuple], upsert: str = INSERT_ROLLUP) -> None:
    """Merge this batch's per-bucket aggregates into metric_rollups (a few rows a key per batch).
    A bucket that got a step at or before one it already had (a resumed job re-logging steps, a
    repeat) is recomputed from its rows, so an overwritten value never lingers as a min or max."""
    rows = []
    for key, g in batch.items():
        row = cur.execute(f"SELECT {ROLLUP_COLS} FROM metric_rollups WHERE job_id = ? AND key_id = ? "
                          "AND attempt = ? AND bucket = ?", key).fetchone()
        old: Optional[Rollup] = Rollup(*row) if row is not None else None
        if key in dirty or (old is not None and (g.first_step <= old.last_step or old.n < 0)):
            lo = key[3] << ROLLUP_SHIFT
            pts = cur.execute("SELECT step, t, value FROM metrics WHERE job_id = ? AND key_id = ? AND attempt = ? "
                              "AND step BETWEEN ? AND ? ORDER BY step",
                              (*key[:3], lo, lo + (1 << ROLLUP_SHIFT) - 1)).fetchall()
            g = Rollup.of_points(pts)
        elif old is not None:
            g = old.followed_by(g)  # appending after the stored points
        rows.append((*key, *g.row()))
    cur.executemany(upsert, rows)
