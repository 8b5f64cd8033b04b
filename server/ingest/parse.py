"""An agent's batch body -> checked events, or a 422 naming the bad event's field.

Metric points, the common event, are checked by hand with the protocol's rules (~1/10 of
pydantic's cost); anything else or anything unusual goes through protocol.Event for its verdict.
"""
from __future__ import annotations

import json
import math
from typing import Any, Optional

import orjson
from pydantic import ValidationError

from server.errors import invalid_body
from tokenpulse.protocol import Event

MAX_EVENTS = 100_000  # per batch, as EventBatch says
INT_LIMIT = 2 ** 63
# Real event data is a few levels deep. Far deeper JSON would fail later (json.dumps at storage,
# the hub's frames) with RecursionError: a 500 that an agent retries forever. It is a 422 here.
MAX_DEPTH = 32


class Ev:
    """A checked event: what protocol.Event holds, without a pydantic object per metric point."""
    __slots__ = ("kind", "job_id", "seq", "t", "data")

    def __init__(self, kind: str, job_id: int, seq: int, t: float, data: dict):
        self.kind, self.job_id, self.seq, self.t, self.data = kind, job_id, seq, t, data


def fast_metric(e: Any) -> Optional[Ev]:
    """The common event, a metrics point, checked by hand: the same rules as protocol.Event +
    MetricsData at ~1/10 of the cost (pydantic: ~15 us an event). Anything not plainly valid returns
    None and goes through the protocol model, which accepts it or explains the 422."""
    if type(e) is not dict or e.get("kind") != "metrics" or len(e) > 5:
        return None
    job_id, seq, t, d = e.get("job_id"), e.get("seq"), e.get("t"), e.get("data")
    if (type(job_id) is not int or job_id < 1 or type(seq) is not int or seq < 0
            or type(d) is not dict or len(d) != 2):
        return None
    if type(t) is not float:
        if type(t) is not int:
            return None
        t = float(t)
    step, values = d.get("step"), d.get("values")
    if type(step) is not int or step < 0 or type(values) is not dict:
        return None
    for k, v in values.items():
        if type(v) is not float or not 0 < len(k) <= 64:
            return None
    return Ev("metrics", job_id, seq, t, d)


def in_range(ev: Ev) -> bool:
    """SQLite integers are 64-bit and a NaN time would be stored as NULL: out of range is a 422, not a 500.
    Applies to both paths (fast or model) alike."""
    return (ev.job_id < INT_LIMIT and ev.seq < INT_LIMIT and math.isfinite(ev.t)
            and (ev.kind != "metrics" or ev.data["step"] < INT_LIMIT))


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether containers nest deeper than limit (iterative: no recursion to overflow)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if type(v) is dict:
            v = v.values()
        elif type(v) is not list:
            continue
        if depth > limit:
            return True
        stack.extend((x, depth + 1) for x in v if type(x) is dict or type(x) is list)
    return False


def load_json(body: bytes) -> Any:
    try:
        return orjson.loads(body)  # ~4x faster than json.loads
    except orjson.JSONDecodeError:
        try:  # NaN/Infinity literals: the stdlib accepts them (stored as non-finite, server/ingest/metrics.py)
            return json.loads(body)
        except RecursionError:  # nesting deeper than the stdlib's stack: a bad body, not a 500
            raise invalid_body((), "invalid JSON: nested too deeply") from None
        except ValueError as e:
            raise invalid_body((), f"invalid JSON: {e}") from None


def parse_batch(body: bytes) -> list[Ev]:
    """{"events": [...]} -> checked events, or RequestValidationError (a 422 like any other)."""
    doc = load_json(body)
    evs = doc.get("events") if isinstance(doc, dict) else None
    if not isinstance(evs, list):
        raise invalid_body(("events",), "Field required: a list of events")
    return parse_events(evs)


def parse_events(evs: list) -> list[Ev]:
    """An EventBatch's events, already loaded from JSON (an agent socket's message) -> checked events."""
    if len(evs) > MAX_EVENTS:
        raise invalid_body(("events",), f"at most {MAX_EVENTS} events a batch")
    out = []
    for i, e in enumerate(evs):
        ev = fast_metric(e)
        if ev is None:
            if too_deep(e):
                raise invalid_body(("events", i), f"nested deeper than {MAX_DEPTH} levels")
            try:
                m = Event.model_validate(e)
            except ValidationError as err:
                first = err.errors()[0]
                raise invalid_body(("events", i) + tuple(first.get("loc", ())), first.get("msg", "invalid")) from None
            ev = Ev(m.kind, m.job_id, m.seq, m.t, m.data)
        if not in_range(ev):
            raise invalid_body(("events", i), "job_id, seq and step must be below 2**63 and t finite")
        out.append(ev)
    return out
