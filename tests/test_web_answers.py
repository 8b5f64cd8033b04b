"""What the server answers a browser or a script beyond the JSON models (issue 25): validation in one
round and in plain words, the app's own 404 page for unknown routes, compressed large answers. One real
server for the whole module."""
from __future__ import annotations

import gzip
import signal

import httpx
import pytest
from conftest import make_server


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = make_server(tmp_path_factory.mktemp("answers")).start()
    yield s
    s.kill(signal.SIGTERM)


def detail(r: httpx.Response) -> dict:
    assert r.status_code == 422, r.text
    return {e["field"]: e["message"] for e in r.json()["detail"]["errors"]}


def test_schema_and_file_errors_in_one_answer_in_plain_words(srv):
    """A bad number and a missing dataset file come back together (not the file after the number is
    fixed); a micro-batch that also takes 'auto' says so; no pydantic jargon."""
    missing = str(srv.data_dir / "nope.jsonl")
    with srv.client() as c:
        got = detail(c.post("/api/jobs", json={"batch_size": "abc", "learning_rate": "fast", "padding": "zz",
                                               "max_steps": 0, "bogus": 1, "dataset": missing}))
        assert got["batch_size"] == "must be a whole number or 'auto'", got
        assert got["learning_rate"] == "must be a number"
        assert got["padding"] == "must be 'auto', 'pack', 'dynamic' or 'max_length'"
        assert got["max_steps"] == "must be at least 1"
        assert "not a setting" in got["bogus"]
        assert "does not exist" in got["dataset"] and "nope.jsonl" in got["dataset"], got
        assert not [m for m in got.values() if "Input should" in m or "pydantic" in m]

        # a schema-valid spec with a wrong model and a wrong dataset: both named at once
        got = detail(c.post("/api/jobs", json={"model": str(srv.data_dir / "no-model"), "dataset": missing}))
        assert set(got) == {"model", "dataset"}, got

        got = detail(c.post("/api/jobs/command", json={"command": []}))
        assert got == {"command": "must not be empty"}, got
        got = detail(c.post("/api/jobs/command", json={"command": "true", "priority": "high", "max_retries": 99}))
        assert got == {"priority": "must be a whole number", "max_retries": "must be at most 20"}, got


def test_unknown_routes_get_the_apps_404_page_in_a_browser_and_json_elsewhere(srv):
    with srv.client() as c:
        r = c.get("/no/such/page", headers={"Accept": "text/html,application/xhtml+xml"})
        assert r.status_code == 404 and "text/html" in r.headers["content-type"], r.headers
        assert "No such page" in r.text and "/no/such/page" in r.text and '{"detail"' not in r.text
        r = c.get("/no/such/page<script>", headers={"Accept": "text/html"})
        assert r.status_code == 404 and "/no/such/page&lt;script&gt;" in r.text  # the path is escaped
        # scripts and the API keep their JSON answers
        r = c.get("/no/such/page")
        assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
        r = c.get("/api/jobs/999999", headers={"Accept": "text/html"})
        assert r.status_code == 404 and "does not exist" in r.json()["detail"]
        r = c.get("/api/nothing-here", headers={"Accept": "text/html"})
        assert r.status_code == 404 and r.json() == {"detail": "Not Found"}


def test_large_answers_are_compressed(srv):
    """A job's metrics JSON is gzipped when the client accepts it (a third of the bytes); small
    answers are sent as they are."""
    agent = httpx.Client(base_url=srv.url, timeout=30, headers={"Authorization": f"Bearer {srv.agent_token}"})
    with srv.client() as c, agent:
        job = c.post("/api/jobs", json={"name": "gzip", "max_steps": 2000}).json()["id"]
        aid = agent.post("/api/agents", json={"name": "gz", "host": "h"}).json()["id"]
        while agent.post(f"/api/agents/{aid}/claim").json().get("job_id") not in (job, None):
            pass
        events = [{"kind": "metrics", "job_id": job, "seq": i, "t": 1000.0 + i,
                   "data": {"step": i + 1, "values": {"loss": 3 - i / 1000, "lr": 2e-4, "tokens_per_s": 9000.5 + i}}}
                  for i in range(1500)]
        for k in range(0, 1500, 500):
            agent.post(f"/api/agents/{aid}/events", json={"events": events[k:k + 500]}).raise_for_status()
        raw = httpx.get(f"{srv.url}/api/jobs/{job}/metrics?max_points=5000", timeout=30,
                        headers={"Authorization": f"Bearer {srv.token}", "Accept-Encoding": "gzip"})
        assert raw.headers.get("content-encoding") == "gzip", raw.headers
        wire = len(gzip.compress(raw.content))  # what went over the wire was about this size
        assert len(raw.content) > 50_000 and int(raw.headers["content-length"]) < len(raw.content) / 2, \
            (len(raw.content), raw.headers["content-length"], wire)
        assert len(raw.json()["series"]["loss"]["step"]) == 1500
        plain = httpx.get(f"{srv.url}/api/jobs/{job}/metrics?max_points=5000", timeout=30,
                          headers={"Authorization": f"Bearer {srv.token}", "Accept-Encoding": "identity"})
        assert "content-encoding" not in plain.headers and plain.json() == raw.json()
        small = c.get("/api/health", headers={"Accept-Encoding": "gzip"})
        assert "content-encoding" not in small.headers
