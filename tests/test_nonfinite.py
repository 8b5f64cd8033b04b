"""NaN and inf metric values are stored and read back where they happened, never dropped: as the
protocol words "nan", "inf", "-inf" through the real batch parser and ingest into a real database
(SQLite, or PostgreSQL with TOKENPULSE_TEST_DB), on the full-point read and on the rollup read of a
long series; the rollups' extremes stay finite and the job's latest values say "nan"."""
from __future__ import annotations

import json
import math

import orjson
import pytest

from server import series
from server.dialect import raw_cursor
from server.ingest.apply import ingest
from server.ingest.metrics import METRIC_KEYS, ROLLUP_COLS, is_finite
from server.ingest.parse import parse_batch
from server.models import Job
from tests.test_series import running_job

STEPS = 70_000  # long enough that a 1,000-point read goes through the rollups
BAD = {120: "nan", 121: "inf", 40_000: "-inf", 65_537: "nan"}


def value(step: int):
    return BAD.get(step, 1.0 + (step % 97) / 100)


def batch(jid: int, steps, value=value) -> bytes:
    """An agent's batch body, one loss point a step (a non-finite one as its protocol word)."""
    return orjson.dumps({"events": [{"kind": "metrics", "job_id": jid, "seq": st, "t": 1e9 + st,
                                     "data": {"step": st, "values": {"loss": value(st)}}} for st in steps]})


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    db, aid, jid = running_job(tmp_path_factory.mktemp("nonfinite"))
    for b in range(0, STEPS, 10_000):
        # the words go through the protocol model, the finite points the fast path
        evs = parse_batch(batch(jid, range(b, b + 10_000)))
        db.write_sync(lambda s, evs=evs: ingest(s, aid, evs))
    yield db, jid, METRIC_KEYS.ids["loss"]
    db.close()


def read(db, jid, kid, max_points, before=None):
    with db.read() as s:
        return series.read_run(raw_cursor(s), jid, kid, 0, max_points, "minmax", None, before)


def test_full_read_returns_each_nonfinite_point_at_its_step_and_the_neighbours_intact(loaded):
    db, jid, kid = loaded
    out = read(db, jid, kid, 1_000, before=999)
    assert not out["downsampled"] and out["step"] == list(range(1000))
    assert out["nonfinite"] == {"120": "nan", "121": "inf"}
    assert out["value"][120] is None and out["value"][121] is None
    assert out["value"][119] == value(119) and out["value"][122] == value(122)
    json.dumps(out, allow_nan=False)  # JSON-safe as the API sends it


def test_rollup_read_keeps_every_nonfinite_point_and_finite_extremes(loaded):
    db, jid, kid = loaded
    out = read(db, jid, kid, 1_000)
    assert out["downsampled"] and out["total_points"] == STEPS
    assert out["nonfinite"] == {str(st): w for st, w in BAD.items()}
    assert all((v is None) == (st in BAD) for st, v in zip(out["step"], out["value"]))
    assert out["step"] == sorted(out["step"])
    assert min(v for v in out["value"] if v is not None) == 1.0
    assert max(v for v in out["value"] if v is not None) == 1.96
    with db.read() as s:
        rolls = raw_cursor(s).execute(f"SELECT {ROLLUP_COLS} FROM metric_rollups WHERE job_id = ? AND key_id = ? "
                                      "ORDER BY bucket", (jid, kid)).fetchall()
    marked = [r for r in rolls if r[0] < 0]
    assert [(r[1] >> 8) for r in marked] == sorted({st >> 8 for st in BAD})  # the buckets holding one
    assert all(is_finite(r[9]) and is_finite(r[12]) for r in rolls)  # min and max never NaN/inf
    assert sum(abs(r[0]) for r in rolls) == STEPS


def test_latest_values_say_nan(loaded):
    db, jid, kid = loaded
    with db.read() as s:
        last = json.loads(s.get(Job, jid).last)
    assert last["loss"] == value(STEPS - 1) and math.isfinite(last["loss"])
    evs = parse_batch(batch(jid, [STEPS], lambda st: "nan"))
    db.write_sync(lambda s: ingest(s, s.get(Job, jid).agent_id, evs))
    with db.read() as s:
        assert json.loads(s.get(Job, jid).last)["loss"] == "nan"
