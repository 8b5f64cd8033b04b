"""The hand-written metric fast path (server/ingest/parse.py fast_metric) pinned to the protocol's
pydantic rules: on every case below, an event the fast path takes is one protocol.Event accepts,
with the same fields, and the verdict of the whole path (fast or model, then the 64-bit range rule)
is the table's. The fast path may decline what the model accepts (it then goes through the model),
but it must take the plain valid case, or ingest loses its speed."""
from __future__ import annotations

import copy
import json

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from server.ingest.parse import Ev, fast_metric, in_range, parse_batch
from tokenpulse.protocol import Event


def metric(**over):
    e = {"kind": "metrics", "job_id": 1, "seq": 0, "t": 1.5, "data": {"step": 3, "values": {"loss": 0.5}}}
    data = over.pop("data", None)
    e.update(over)
    if data is not None:
        e["data"] = data
    return e


def values(v):
    return metric(data={"step": 3, "values": v})


def step(s):
    return metric(data={"step": s, "values": {"loss": 0.5}})


BIG = 2 ** 63
# (case, event, accepted by the whole path, taken by the fast path)
CASES = [
    ("valid", metric(), True, True),
    ("int time", metric(t=2), True, True),
    ("no values", values({}), True, True),
    ("64-char name", values({"x" * 64: 1.0}), True, True),
    ("many names", values({f"m{i}": float(i) for i in range(50)}), True, True),
    ("NaN value", values({"loss": float("nan")}), True, True),
    ("infinite value", values({"loss": float("inf")}), True, True),
    ("missing step", metric(data={"values": {"loss": 0.5}}), False, False),
    ("missing values", metric(data={"step": 3}), False, False),
    ("negative step", step(-1), False, False),
    ("step 2**63 - 1", step(BIG - 1), True, True),
    ("step 2**63", step(BIG), False, True),
    ("step past 2**63", step(BIG * 4), False, True),
    ("float step", step(3.0), True, False),
    ("fractional step", step(3.5), False, False),
    ("string step", step("3"), True, False),
    ("word step", step("three"), False, False),
    ("bool step", step(True), True, False),
    ("null step", step(None), False, False),
    ("bool value", values({"loss": True}), True, False),
    ("int value", values({"loss": 1}), True, False),
    ("numeric string value", values({"loss": "0.5"}), True, False),
    ("string value", values({"loss": "low"}), False, False),
    ("null value", values({"loss": None}), False, False),
    ("nested value", values({"loss": {"a": 1.0}}), False, False),
    ("list value", values({"loss": [1.0]}), False, False),
    ("empty name", values({"": 1.0}), False, False),
    ("65-char name", values({"x" * 65: 1.0}), False, False),
    ("values a list", metric(data={"step": 3, "values": [0.5]}), False, False),
    ("data a list", metric(data=[3]), False, False),
    ("extra key in data", metric(data={"step": 3, "values": {"loss": 0.5}, "epoch": 1}), True, False),
    ("extra key in event", {**metric(), "rank": 0}, True, False),
    ("missing job_id", {k: v for k, v in metric().items() if k != "job_id"}, False, False),
    ("job_id 0", metric(job_id=0), False, False),
    ("string job_id", metric(job_id="1"), True, False),
    ("job_id 2**63", metric(job_id=BIG), False, True),
    ("negative seq", metric(seq=-1), False, False),
    ("seq 2**63", metric(seq=BIG), False, True),
    ("float seq", metric(seq=1.5), False, False),
    ("string time", metric(t="now"), False, False),
    ("null time", metric(t=None), False, False),
    ("NaN time", metric(t=float("nan")), False, True),
    ("bool time", metric(t=True), True, False),
    ("other kind", metric(kind="metric"), False, False),
    ("no kind", {k: v for k, v in metric().items() if k != "kind"}, False, False),
    ("not an object", [metric()], False, False),
]


def through_model(e) -> Ev | None:
    try:
        m = Event.model_validate(e)
    except ValidationError:
        return None
    return Ev(m.kind, m.job_id, m.seq, m.t, m.data)


@pytest.mark.parametrize("case,event,accepted,fast", CASES, ids=[c[0] for c in CASES])
def test_fast_path_agrees_with_the_protocol(case, event, accepted, fast):
    by_fast = fast_metric(copy.deepcopy(event))
    by_model = through_model(copy.deepcopy(event))
    assert (by_fast is not None) == fast, "the fast path's reach changed"
    if by_fast is not None:  # what the fast path takes, the model takes, with the same fields
        assert by_model is not None
        got = (by_fast.kind, by_fast.job_id, by_fast.seq, by_fast.t, by_fast.data)
        want = (by_model.kind, by_model.job_id, by_model.seq, by_model.t, by_model.data)
        assert repr(got) == repr(want)  # repr: NaN equals itself, and 2 differs from 2.0
    verdict = by_fast or by_model
    assert (verdict is not None and in_range(verdict)) == accepted


@pytest.mark.parametrize("case,event,accepted,fast", CASES, ids=[c[0] for c in CASES])
def test_the_ingest_route_parser_gives_the_same_verdict(case, event, accepted, fast):
    # the stdlib writes NaN/Infinity literals and big integers, as an agent's json.dumps would
    body = json.dumps({"events": [event]}).encode()
    try:
        parse_batch(body)
        ok = True
    except RequestValidationError:
        ok = False
    assert ok == accepted
