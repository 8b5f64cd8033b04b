"""Server-side downsampling of metric series, so a chart of a million points costs what one of a
thousand does. minmax keeps, per bucket, the first, last, minimum and maximum point (spikes
survive); lttb keeps the visually most significant point per bucket.

Long series are not read point by point: ingest keeps a rollup row per 256 steps (first, last, min,
max; server/ingest/metrics.py), and a chart bucket is a whole number of rollups, so 1,000 points out of
1,000,000 read ~4,000 rollup rows (~5 ms) instead of a million points (~400 ms).

A NaN/inf point is never downsampled away: every one in range is returned, its value null (JSON has
no NaN) and its word in the series' `nonfinite` map ({step: "nan" | "inf" | "-inf"}). A long series
finds them through its marked rollups (n < 0, server/ingest/metrics.py), reading only those buckets.
"""
from __future__ import annotations

from operator import itemgetter
from typing import Optional, Sequence

from server.ingest.metrics import ROLLUP_COLS, ROLLUP_SHIFT, Rollup, is_finite
from tokenpulse.protocol import nonfinite_word


def read_series(cur, job_id: int, key_id: int, attempt: int, max_points: int, mode: str = "minmax",
                after_step: Optional[int] = None, before_step: Optional[int] = None) -> Optional[dict]:
    """One metric of one attempt of one job, downsampled above max_points. cur: a raw DBAPI cursor
    (dialect.raw_cursor; the metrics primary key (job_id, key_id, attempt, step) serves every query
    here: see EXPLAIN in the bench)."""
    where, params = "job_id = ? AND key_id = ? AND attempt = ?", [job_id, key_id, attempt]
    if after_step is not None:
        where += " AND step > ?"
        params.append(after_step)
    if before_step is not None:
        where += " AND step <= ?"
        params.append(before_step)
    # Two index seeks (SQLite's min/max optimization needs one aggregate per query).
    lo = cur.execute(f"SELECT MIN(step) FROM metrics WHERE {where}", params).fetchone()[0]
    if lo is None:
        return None
    hi = cur.execute(f"SELECT MAX(step) FROM metrics WHERE {where}", params).fetchone()[0]
    buckets = max(1, max_points // 4)
    if (hi - lo + 1) >> ROLLUP_SHIFT >= buckets:  # at least one rollup per chart bucket
        rolls = rollups(cur, job_id, key_id, attempt, lo, hi)
        total = sum(abs(r[0]) for r in rolls)
        if total > max_points:
            picked = from_rollups(rolls, buckets) if mode != "lttb" else lttb(rollup_points(rolls), max_points)
            bad = [p for r in rolls if r[0] < 0 for p in cur.execute(
                "SELECT step, t, value FROM metrics WHERE job_id = ? AND key_id = ? AND attempt = ? "
                "AND step BETWEEN ? AND ?", (job_id, key_id, attempt, r[1], r[4])) if not is_finite(p[2])]
            out = columns(picked)
            out["downsampled"] = True
            out["total_points"] = total
            return with_nonfinite(out, bad)
    rows = cur.execute(f"SELECT step, t, value FROM metrics WHERE {where} ORDER BY step", params).fetchall()
    bad = [] if all_finite(rows) else [r for r in rows if not is_finite(r[2])]
    if bad:
        rows = [r for r in rows if is_finite(r[2])]
    return with_nonfinite(downsample(rows, max_points, mode), bad)


def all_finite(rows: Sequence[tuple]) -> bool:
    """Whether every value is a finite number, at C speed (~5x a check per row): a sum is finite
    unless a value is NaN/inf (or finite values overflow it: then the caller merely looks row by row)."""
    try:
        total = sum(map(_value, rows))
    except TypeError:  # SQLite's 'nan' text
        return False
    return total - total == 0


def with_nonfinite(out: dict, bad: list[tuple]) -> dict:
    """The series with its non-finite points (step, t, value) put back in step order: value null, and
    its word in out["nonfinite"] by step."""
    if not bad:
        return out
    words = {step: v if type(v) is str else nonfinite_word(v) for step, _, v in bad}
    pts = {step: (step, t, None) for step, t, _ in bad}
    pts.update((p[0], p) for p in zip(out["step"], out["t"], out["value"]) if p[0] not in words)
    out.update(columns(sorted(pts.values(), key=_step)))
    out["nonfinite"] = {str(step): w for step, w in words.items()}  # JSON's keys are text
    return out


def read_run(cur, job_id: int, key_id: int, attempt: int, max_points: int, mode: str = "minmax",
             after_step: Optional[int] = None, before_step: Optional[int] = None,
             by_time: bool = False) -> Optional[dict]:
    """One metric of a job as attempt `attempt` ran it: the attempt's own points and, before its first
    step, the points of the attempt it resumed from (and so on back): a checkpoint resume continues
    the run, a fresh start (from step 0) shows its own points alone. by_time: a series keyed by time
    (the sys/ samples), where each attempt simply follows the one before."""
    parts: list[dict] = []
    hi = before_step
    for a in range(attempt, -1, -1):
        if hi is not None and after_step is not None and hi <= after_step:
            break
        ser = read_series(cur, job_id, key_id, a, max_points, mode, after_step, hi)
        if ser is not None:
            parts.append(ser)
        start = ser["step"][0] if ser is not None and (by_time or ser["step"][0] <= 0) else \
            None if by_time else first_step(cur, job_id, a)
        if start is None:
            continue  # the attempt logged nothing: the one before it is still the run
        if start <= 0:
            break
        hi = start - 1 if hi is None else min(hi, start - 1)
    if len(parts) < 2:
        return parts[0] if parts else None
    parts.reverse()  # oldest first: steps ascending
    rows = [p for part in parts for p in zip(part["step"], part["t"], part["value"])]
    total = sum(part.get("total_points", len(part["step"])) for part in parts)
    words = {int(step): w for part in parts for step, w in part.get("nonfinite", {}).items()}
    bad = [(step, t, words[step]) for step, t, v in rows if v is None and step in words]
    if bad:
        rows = [r for r in rows if r[2] is not None]
    out = downsample(rows, max_points, mode)
    if total > len(rows) + len(bad) or out["downsampled"]:
        out["downsampled"], out["total_points"] = True, total
    return with_nonfinite(out, bad)


def first_step(cur, job_id: int, attempt: int) -> Optional[int]:
    """The first step an attempt logged (any metric but the sys/ samples, keyed by time): where it
    started, from step 0 or from a checkpoint. From the rollups: a few thousand rows at most."""
    return cur.execute("SELECT MIN(r.first_step) FROM metric_rollups r JOIN metric_keys k ON k.id = r.key_id "
                       "WHERE r.job_id = ? AND r.attempt = ? AND k.name NOT LIKE ?",  # a parameter: '%' is
                       (job_id, attempt, "sys/%")).fetchone()[0]  # psycopg's placeholder sign


# A rollup row as read (ROLLUP_COLS order: n, then the first, last, min and max point's step, t,
# value): plain tuples and itemgetters, no object per row, as a chart of a million points reads ~4,000.
def _min_value(r: tuple) -> float:
    return r[9] if is_finite(r[9]) else float("inf")  # a bucket of non-finite points only: never the lowest


def _max_value(r: tuple) -> float:
    return r[12] if is_finite(r[12]) else float("-inf")


def _first(r: tuple) -> tuple:
    return r[1:4]


def _last(r: tuple) -> tuple:
    return r[4:7]


def _low(r: tuple) -> tuple:
    return r[7:10]


def _high(r: tuple) -> tuple:
    return r[10:13]


def rollups(cur, job_id: int, key_id: int, attempt: int, lo: int, hi: int) -> list[tuple]:
    """The rollup rows covering steps lo..hi; a rollup cut by lo or hi (an after_step/before_step
    range) is recomputed from its points inside the range."""
    rolls = cur.execute(
        f"SELECT {ROLLUP_COLS} FROM metric_rollups WHERE job_id = ? AND key_id = ? AND attempt = ? "
        "AND bucket BETWEEN ? AND ? ORDER BY bucket",
        (job_id, key_id, attempt, lo >> ROLLUP_SHIFT, hi >> ROLLUP_SHIFT)).fetchall()
    for i in {0, len(rolls) - 1} if rolls else ():
        r = rolls[i]
        if r[1] < lo or r[4] > hi:  # its first step before lo, or its last after hi
            pts = cur.execute("SELECT step, t, value FROM metrics WHERE job_id = ? AND key_id = ? AND attempt = ? "
                              "AND step BETWEEN ? AND ? ORDER BY step",
                              (job_id, key_id, attempt, max(lo, r[1]), min(hi, r[4]))).fetchall()
            rolls[i] = Rollup.of_points(pts).row()
    return rolls


def from_rollups(rolls: list[tuple], buckets: int) -> list[tuple]:
    """minmax over whole rollups: each chart bucket merges k consecutive rollups."""
    k = -(-len(rolls) // buckets)
    out: list[tuple] = []
    for b in range(0, len(rolls), k):
        group = rolls[b:b + k]
        first, last = _first(group[0]), _last(group[-1])
        mn, mx = _low(min(group, key=_min_value)), _high(max(group, key=_max_value))
        out.extend(sorted((p for p in {first, mn, mx, last} if is_finite(p[2])), key=_step))
    return out


def rollup_points(rolls: list[tuple]) -> list[tuple]:
    out: list[tuple] = []
    for r in rolls:
        out.extend(sorted((p for p in {_first(r), _last(r), _low(r), _high(r)} if is_finite(p[2])), key=_step))
    return out


_step, _value = itemgetter(0), itemgetter(2)


def columns(rows: Sequence[tuple]) -> dict:
    return {"step": list(map(itemgetter(0), rows)), "t": list(map(itemgetter(1), rows)),
            "value": list(map(itemgetter(2), rows))}


def downsample(rows: Sequence[tuple], max_points: int, mode: str = "minmax") -> dict:
    n = len(rows)
    if n <= max_points:
        out = columns(rows)
        out["downsampled"] = False
        return out
    picked = lttb(rows, max_points) if mode == "lttb" else minmax(rows, max_points)
    out = columns(picked)
    out["downsampled"] = True
    out["total_points"] = n
    return out


def minmax(rows: Sequence[tuple], max_points: int) -> list[tuple]:
    buckets = max(1, max_points // 4)
    size = len(rows) / buckets
    out: list[tuple] = []
    for b in range(buckets):
        lo, hi = int(b * size), int((b + 1) * size)
        if lo >= hi:
            continue
        chunk = rows[lo:hi]
        first, last = chunk[0], chunk[-1]
        mn = min(chunk, key=lambda r: r[2])
        mx = max(chunk, key=lambda r: r[2])
        # Keep step order; a point that is several of these at once is kept once.
        out.extend(sorted({first, mn, mx, last}, key=lambda r: r[0]))
    return out


def lttb(rows: Sequence[tuple], threshold: int) -> list[tuple]:
    """Largest-Triangle-Three-Buckets (Steinarsson 2013)."""
    n = len(rows)
    if threshold >= n or threshold < 3:
        return list(rows)
    every = (n - 2) / (threshold - 2)
    out = [rows[0]]
    a = 0
    for i in range(threshold - 2):
        s, e = int((i + 1) * every) + 1, min(int((i + 2) * every) + 1, n)
        avg_x = sum(r[0] for r in rows[s:e]) / max(1, e - s)
        avg_y = sum(r[2] for r in rows[s:e]) / max(1, e - s)
        lo, hi = int(i * every) + 1, int((i + 1) * every) + 1
        ax, ay = rows[a][0], rows[a][2]
        best, best_area = lo, -1.0
        for j in range(lo, hi):
            area = abs((ax - avg_x) * (rows[j][2] - ay) - (ax - rows[j][0]) * (avg_y - ay))
            if area > best_area:
                best, best_area = j, area
        out.append(rows[best])
        a = best
    out.append(rows[-1])
    return out
