"""Downsampling keeps the first, last, minimum and maximum point of every bucket: on raw rows, and
on the 256-step rollups ingest keeps (the fast path for long series), edges cut by a step range
included."""
from __future__ import annotations

import math
import random

import pytest

from server import series, store
from server.db import Database, upgrade_to_head
from server.dialect import raw_cursor
from server.ingest.apply import ingest
from server.ingest.metrics import METRIC_KEYS
from server.ingest.parse import Ev
from server.models import Agent
from tests import pg
from tokenpulse.protocol import JobSpec


def walk(n: int, seed: int = 0) -> list[float]:
    rnd, v, out = random.Random(seed), 0.0, []
    for _ in range(n):
        v += rnd.gauss(0, 1)
        out.append(v + (1000.0 if rnd.random() < 0.001 else 0.0) - (1000.0 if rnd.random() < 0.001 else 0.0))
    return out


def assert_keeps_extremes(rows: list[tuple], out: dict, edges: list[int]) -> None:
    """For each bucket [edges[i], edges[i+1]): its first, last, min and max point are in out."""
    got = set(zip(out["step"], out["t"], out["value"]))
    assert out["step"] == sorted(out["step"])
    for lo, hi in zip(edges, edges[1:]):
        chunk = [r for r in rows if lo <= r[0] < hi]
        if not chunk:
            continue
        for p in (chunk[0], chunk[-1], min(chunk, key=lambda r: r[2]), max(chunk, key=lambda r: r[2])):
            # ties: any point with the extreme value will do
            assert p in got or any(q[2] == p[2] and lo <= q[0] < hi for q in got), (lo, hi, p)


def test_minmax_on_rows_keeps_first_last_min_max_of_each_bucket():
    vals = walk(10_007)
    rows = [(i, 1e9 + i, v) for i, v in enumerate(vals)]
    out = series.downsample(rows, 400, "minmax")
    assert out["downsampled"] and out["total_points"] == len(rows) and len(out["step"]) <= 400
    size = len(rows) / 100
    assert_keeps_extremes(rows, out, [rows[int(b * size)][0] for b in range(100)] + [len(rows)])
    assert max(out["value"]) == max(vals) and min(out["value"]) == min(vals)
    small = series.downsample(rows[:50], 400)
    assert not small["downsampled"] and small["step"] == list(range(50))


def test_lttb_keeps_ends_and_size():
    rows = [(i, 0.0, v) for i, v in enumerate(walk(5000, 1))]
    out = series.downsample(rows, 300, "lttb")
    assert len(out["step"]) == 300 and out["step"][0] == 0 and out["step"][-1] == 4999


def running_job(folder) -> tuple[Database, int, int]:
    """A fresh database in folder (SQLite, or PostgreSQL with TOKENPULSE_TEST_DB) holding one running
    job on one agent: (db, agent id, job id)."""
    url = pg.database_url(folder)
    METRIC_KEYS.ids.clear()  # the process-wide name -> id cache belongs to another database
    upgrade_to_head(url)
    db = Database(url)

    def setup(s):
        a = Agent(name="a", host="h", device="cpu", capacity=1, state="online", created_at=0.0, seen_at=0.0)
        s.add(a)
        s.flush()
        job = store.create_job(s, JobSpec(), None)
        job.state, job.agent_id = "running", a.id
        return a.id, job.id
    return db, *db.write_sync(setup)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """A job with 150,000 steps of one metric (spikes included), stored by ingest in batches."""
    db, aid, jid = running_job(tmp_path_factory.mktemp("series"))
    vals = walk(150_000, 2)
    for b in range(0, len(vals), 10_000):
        evs = [Ev("metrics", jid, s, 1e9 + s, {"step": s, "values": {"loss": vals[s]}}) for s in range(b, b + 10_000)]
        db.write_sync(lambda s, evs=evs: ingest(s, aid, evs))
    rows = [(s, 1e9 + s, v) for s, v in enumerate(vals)]
    kid = METRIC_KEYS.ids["loss"]
    yield db, jid, kid, rows
    db.close()


def read(db, jid, kid, max_points, mode="minmax", after=None, before=None):
    with db.read() as s:
        # the job was never claimed: its points are attempt 0's
        return series.read_series(raw_cursor(s), jid, kid, 0, max_points, mode, after, before)


def rollup_edges(lo: int, hi: int, buckets: int) -> list[int]:
    first, last = lo >> series.ROLLUP_SHIFT, hi >> series.ROLLUP_SHIFT
    k = math.ceil((last - first + 1) / buckets)
    return [max(lo, (first + j) << series.ROLLUP_SHIFT) for j in range(0, last - first + 1, k)] + [hi + 1]


def test_rollup_path_keeps_first_last_min_max_of_each_bucket(loaded):
    db, jid, kid, rows = loaded
    out = read(db, jid, kid, 1000)
    assert out["downsampled"] and out["total_points"] == len(rows) and len(out["step"]) <= 1000
    assert_keeps_extremes(rows, out, rollup_edges(0, len(rows) - 1, 250))
    assert max(out["value"]) == max(r[2] for r in rows) and min(out["value"]) == min(r[2] for r in rows)
    assert out["step"][0] == 0 and out["step"][-1] == len(rows) - 1


def test_rollup_path_with_a_step_range_cutting_rollups(loaded):
    db, jid, kid, rows = loaded
    after, before = 1000, 140_100  # neither on a 256-step boundary
    out = read(db, jid, kid, 800, after=after, before=before)
    inside = [r for r in rows if after < r[0] <= before]
    assert out["total_points"] == len(inside)
    assert out["step"][0] == after + 1 and out["step"][-1] == before
    assert_keeps_extremes(inside, out, rollup_edges(after + 1, before, 200))


def test_rollup_lttb_and_full_reads(loaded):
    db, jid, kid, rows = loaded
    out = read(db, jid, kid, 1000, mode="lttb")
    assert len(out["step"]) == 1000 and out["step"][0] == 0 and out["step"][-1] == len(rows) - 1
    full = read(db, jid, kid, 1_000_000)
    assert not full["downsampled"] and full["value"] == [r[2] for r in rows]
    near = read(db, jid, kid, 1000, after=149_000)  # short range: raw rows, exact
    assert near["step"] == list(range(149_001, 150_000))
