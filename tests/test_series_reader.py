"""The series reader (server/series.read_series) on a real, migrated SQLite database with points
stored by ingest (rollups included): short series whole, long ones downsampled through the rollups
keeping each bucket's first/last/min/max, step ranges, point limits, unknown series, and each
attempt's points kept apart."""
from __future__ import annotations

from contextlib import contextmanager

import pytest

from server import store
from server.dialect import raw_cursor
from server.ingest.apply import ingest
from server.ingest.metrics import METRIC_KEYS, ROLLUP_SHIFT
from server.ingest.parse import Ev
from server.series import read_run, read_series
from tests.realdb import add_agent, migrated_session
from tokenpulse.protocol import JobSpec, JobState

N = 7_700  # 30 whole rollups of 256 steps and a partial one


def value(step: int) -> float:
    """A sawtooth with one spike up and one down, so the extremes are known."""
    return {1234: 500.0, 5000: -500.0}.get(step, float(step % 97))


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    with migrated_session(tmp_path_factory.mktemp("series")) as s:
        agent = add_agent(s)
        job = store.create_job(s, JobSpec())
        store.claim(s, agent.id)
        store.transition(s, job, JobState.running)
        for lo in range(0, N, 1000):
            ingest(s, agent.id, [Ev("metrics", job.id, st, 1e9 + st, {"step": st, "values": {"loss": value(st)}})
                                 for st in range(lo, min(N, lo + 1000))])
        ingest(s, agent.id, [Ev("metrics", job.id, N + i, 2e9, {"step": i, "values": {"lr": 0.1 * i}})
                             for i in range(10)])
        cur = raw_cursor(s)
        assert cur.execute("SELECT COUNT(*) FROM metric_rollups WHERE job_id = ? AND key_id = ?",
                           (job.id, METRIC_KEYS.ids["loss"])).fetchone()[0] == -(-N >> ROLLUP_SHIFT)
        yield cur, job.id


def read(stored, key="loss", **kw):
    cur, job_id = stored
    return read_series(cur, job_id, METRIC_KEYS.ids[key], 1, **kw)


def points(out: dict) -> list[tuple]:
    return list(zip(out["step"], out["t"], out["value"]))


def test_a_short_series_comes_back_whole(stored):
    out = read(stored, "lr", max_points=100)
    assert out["downsampled"] is False and "total_points" not in out
    assert out["step"] == list(range(10)) and out["t"] == [2e9] * 10 and out["value"][3] == pytest.approx(0.3)


def test_a_long_series_is_downsampled_through_the_rollups_keeping_first_last_min_max(stored):
    out = read(stored, max_points=40)  # 10 chart buckets of 4 points; 31 rollups -> 4 rollups a bucket
    assert out["downsampled"] is True and out["total_points"] == N
    assert len(out["step"]) <= 40 and out["step"] == sorted(out["step"])
    got = set(points(out))
    span = 4 << ROLLUP_SHIFT  # a chart bucket is a whole number of rollups (1024 steps), not N / 10
    for lo in range(0, N, span):
        steps = range(lo, min(N, lo + span))
        bucket = [(st, 1e9 + st, value(st)) for st in steps]
        first, last = bucket[0], bucket[-1]
        assert first in got and last in got, lo
        assert min(p[2] for p in got if lo <= p[0] < lo + span) == min(p[2] for p in bucket)
        assert max(p[2] for p in got if lo <= p[0] < lo + span) == max(p[2] for p in bucket)
    assert (1234, 1e9 + 1234, 500.0) in got and (5000, 1e9 + 5000, -500.0) in got


def test_lttb_keeps_both_ends_within_the_limit(stored):
    out = read(stored, max_points=50, mode="lttb")
    assert out["downsampled"] and len(out["step"]) <= 50
    assert out["step"][0] == 0 and out["step"][-1] == N - 1


def test_a_step_range_cuts_rollups_and_counts_only_points_inside(stored):
    out = read(stored, max_points=8, after_step=1000, before_step=3000)  # cuts rollups 3 and 11
    assert out["downsampled"] and out["total_points"] == 2000
    assert min(out["step"]) == 1001 and max(out["step"]) == 3000
    assert max(out["value"]) == 500.0  # the spike at 1234 is inside
    out = read(stored, max_points=8, after_step=1300, before_step=4999)
    assert -500.0 not in out["value"] and 500.0 not in out["value"]  # both spikes outside
    assert min(out["step"]) == 1301 and max(out["step"]) == 4999 and out["total_points"] == 3699


def test_a_narrow_range_comes_back_whole(stored):
    out = read(stored, max_points=1000, after_step=99, before_step=120)
    assert out["downsampled"] is False and out["step"] == list(range(100, 121))
    assert out["value"] == [value(st) for st in range(100, 121)]


def test_limits_and_empty_ranges(stored):
    assert len(read(stored, max_points=N)["step"]) == N  # exactly the limit: whole
    assert read(stored, max_points=N - 1)["downsampled"] is True
    assert read(stored, max_points=100, after_step=N) is None
    assert read(stored, max_points=100, before_step=-1) is None
    cur, job_id = stored
    assert read_series(cur, job_id + 1, METRIC_KEYS.ids["loss"], 1, 100) is None  # another job
    assert read_series(cur, job_id, METRIC_KEYS.ids["loss"], 2, 100) is None  # an attempt that logged nothing


@contextmanager
def two_attempts(tmp_path, second: dict):
    """A job whose attempt 1 logged loss 1.0 at steps 0-599 and whose attempt 2 logged `second`
    ({step: loss}); yields (cursor, job id, the loss key id)."""
    with migrated_session(tmp_path) as s:
        agent = add_agent(s)
        job = store.create_job(s, JobSpec())
        for attempt, points in ((1, {st: 1.0 for st in range(600)}), (2, second)):
            assert store.claim(s, agent.id).attempt == attempt
            store.transition(s, job, JobState.running)
            seq = 600 * (attempt - 1)
            ingest(s, agent.id, [Ev("metrics", job.id, seq + i, attempt * 1e9 + i, {"step": st, "values": {"loss": v}})
                                 for i, (st, v) in enumerate(points.items())])
            store.transition(s, job, JobState.queued)
        yield raw_cursor(s), job.id, METRIC_KEYS.ids["loss"]


def test_a_later_attempt_repeating_steps_never_overwrites_an_earlier_one(tmp_path):
    """A fix that restarts from step 0: the new attempt's steps 0..299 are points of their own; the
    first attempt's 600 points and its rollups (the chart's fast path) stay as they were."""
    with two_attempts(tmp_path, {st: 2.0 + st for st in range(300)}) as (cur, job_id, kid):
        first, second = (read_series(cur, job_id, kid, a, 10_000) for a in (1, 2))
        assert first["step"] == list(range(600)) and set(first["value"]) == {1.0}
        assert second["step"] == list(range(300)) and second["value"][-1] == 301.0
        down = read_series(cur, job_id, kid, 1, 8)  # through attempt 1's rollups
        assert down["downsampled"] and down["total_points"] == 600 and set(down["value"]) == {1.0}
        # the run as attempt 2 ran it: a fresh start (from step 0) is its own points alone
        assert read_run(cur, job_id, kid, 2, 10_000)["step"] == list(range(300))


def test_a_resumed_attempt_continues_the_run_it_resumed(tmp_path):
    """Attempt 2 resumes from a checkpoint at step 400 (attempt 1 had logged up to 599): the run as
    attempt 2 ran it is attempt 1's steps 0-400, then attempt 2's own from 401; attempt 1's 401-599
    stay its own."""
    with two_attempts(tmp_path, {st: 2.0 for st in range(401, 701)}) as (cur, job_id, kid):
        run = read_run(cur, job_id, kid, 2, 10_000)
        assert run["step"] == list(range(701)) and run["downsampled"] is False
        assert set(run["value"][:401]) == {1.0} and set(run["value"][401:]) == {2.0}
        down = read_run(cur, job_id, kid, 2, 40)
        assert down["downsampled"] and down["total_points"] == 701 and len(down["step"]) <= 40
        assert read_run(cur, job_id, kid, 2, 10_000, after_step=500)["step"] == list(range(501, 701))
        assert read_series(cur, job_id, kid, 1, 10_000)["step"] == list(range(600))
