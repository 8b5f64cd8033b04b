"""Preflight everywhere (issue 15 item 5): the automatic max length covers the longest example when
that costs little, truncation above 1% of examples is an alert, and the analysis's warnings (with
their fixes) come back from a submit and are printed by `tokenpulse submit`."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
from conftest import ROOT

from tokenpulse.preflight import analysis_warnings, spec_warnings
from tokenpulse.protocol import JobSpec
from worker.training.analysis import analyze_lengths, recommend_max_len


def issue_lengths() -> np.ndarray:
    """10,000 examples: p99.9 at 1,427 tokens, the longest 1,481, 8 examples above 1,440."""
    rng = np.random.default_rng(0)
    body = np.sort(rng.integers(20, 1400, 9989))
    tail = [1427, 1436, 1438, 1445, 1450, 1455, 1460, 1466, 1470, 1475, 1481]
    return np.concatenate([body, tail])


def test_auto_max_length_covers_the_longest_example_when_that_costs_little():
    lengths = issue_lengths()
    assert len(lengths) == 10_000 and lengths.max() == 1481
    assert round(float(np.percentile(lengths, 99.9))) == 1427
    assert (lengths > 1440).sum() == 8  # what the percentile alone (1,440) would cut
    assert recommend_max_len(lengths, 99.9) == 1488
    a = analyze_lengths(lengths, 99.9)
    assert a["recommended_max_seq_length"] == 1488 and a["truncated"] == 0
    # padding every row to max_length makes every row pay for the longer length: the percentile only
    assert recommend_max_len(lengths, 99.9, pad_all=True) == 1440
    # a far longer outlier is not worth it (memory and attention follow the longest row)
    assert recommend_max_len(np.concatenate([lengths, [4000]]), 99.9) == 1440
    # the model's limit still wins
    assert recommend_max_len(lengths, 99.9, model_max=1024) == 1024


def test_warning_rules_name_the_field_and_the_fix():
    lengths = issue_lengths()
    spec = JobSpec(max_seq_length=512)
    got = analysis_warnings(spec, analyze_lengths(lengths, 99.9, max_seq_length=512))
    assert [w["kind"] for w in got] == ["truncation"] and got[0]["field"] == "max_seq_length"
    assert "max_seq_length=1488" in got[0]["fix"] and "are longer than max_seq_length=512" in got[0]["message"]
    spec = JobSpec(max_seq_length=2048, padding="max_length")
    got = analysis_warnings(spec, analyze_lengths(lengths, 99.9, max_seq_length=2048, pad_all=True))
    assert [w["kind"] for w in got] == ["padding"] and got[0]["field"] == "padding"
    assert got[0]["fix"].startswith("padding=auto (packing") and "wastes 65%" in got[0]["message"], got
    dyn = JobSpec(padding="dynamic")
    got = analysis_warnings(dyn, analyze_lengths(lengths, 99.9))
    assert [w["kind"] for w in got] == ["padding"] and "group_by_length=true" in got[0]["fix"]
    assert analysis_warnings(JobSpec(), analyze_lengths(lengths, 99.9)) == []  # the defaults are fine
    w = spec_warnings(JobSpec(streaming=True, epochs=2))
    assert w[0]["field"] == "epochs" and w[0]["fix"] == "set max_steps instead of epochs"
    assert spec_warnings(JobSpec(streaming=True, epochs=2, max_steps=10))[0]["fix"] == "leave epochs out"


def test_truncation_above_one_percent_is_an_alert(tmp_path):
    from test_training import Recorder, quick_spec

    from worker.training.controls import Controls
    from worker.training.session import Session
    em = Recorder()
    assert Session(quick_spec(max_steps=1, max_seq_length=32), tmp_path, em, Controls()).run() == 0
    alerts = [d for k, d in em.events if k == "alert" and d["kind"] == "truncation"]
    assert len(alerts) == 1 and alerts[0]["severity"] == "warning", alerts
    assert "max_seq_length=32 and are cut" in alerts[0]["message"] and "max_seq_length=2" in alerts[0]["message"]
    em = Recorder()  # the automatic length cuts (almost) nothing: no alert
    assert Session(quick_spec(max_steps=1), tmp_path / "b", em, Controls()).run() == 0
    assert not [d for k, d in em.events if k == "alert" and d["kind"] == "truncation"]


def test_submit_answers_with_warnings_and_their_fixes(server_factory, tmp_path):
    """REST: the analysis's warnings come back with the created job (which is queued as asked); the
    analysis runs in a child once per data and settings, then comes from the cache; automatic
    settings need no analysis. CLI: `tokenpulse submit` prints each warning with its fix."""
    s = server_factory(preflight_wait_s=300)  # a loaded test box: never "still running" here
    with s.client() as c:
        r = c.post("/api/jobs", json={"name": "cut", "max_seq_length": 32})
        assert r.status_code == 201, r.text
        job = r.json()
        assert job["state"] == "queued" and job["preflight"]["analysis"] == "done", job["preflight"]
        (w,) = job["warnings"]
        assert w["kind"] == "truncation" and w["field"] == "max_seq_length", w
        assert "are longer than max_seq_length=32" in w["message"] and w["fix"].startswith("max_seq_length=")
        again = c.post("/api/jobs", json={"name": "cut again", "max_seq_length": 32}).json()
        assert again["preflight"]["analysis"] == "cached" and again["warnings"] == job["warnings"]
        assert again["preflight"]["seconds"] < 2
        r = c.post("/api/jobs", json={"padding": "max_length", "max_seq_length": 1024}).json()
        assert [w["kind"] for w in r["warnings"]] == ["padding"] and "padding=auto" in r["warnings"][0]["fix"]
        r = c.post("/api/jobs", json={"name": "auto"}).json()
        assert r["warnings"] == [] and r["preflight"]["analysis"] == "not needed"
        r = c.post("/api/jobs", json={"streaming": True, "epochs": 1, "max_steps": 5}).json()
        assert [w["field"] for w in r["warnings"]] == ["epochs"], r["warnings"]
        assert c.get(f"/api/jobs/{job['id']}").json()["state"] == "queued"  # advice only
    path = tmp_path / "job.yaml"
    path.write_text("name: from-cli\nmax_seq_length: 32\n")
    env = {**os.environ, "TOKENPULSE_URL": s.url, "TOKENPULSE_TOKEN": s.token, "COLUMNS": "250"}
    out = subprocess.run([sys.executable, "-m", "tokenpulse.cli", "submit", str(path)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "queued" in out.stdout and f"warning max_seq_length: {w['message']}" in out.stdout, out.stdout
    assert f"fix: {w['fix']}" in out.stdout, out.stdout


def test_batch_size_far_from_an_earlier_measurement_is_a_warning(server):
    """A fixed batch_size against what an earlier job on the same model and data measured (its
    autotune table, reported by its agent as an info event)."""
    import httpx
    agent = httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {server.agent_token}"})
    aid = agent.post("/api/agents", json={"name": "fake", "host": "h"}).json()["id"]
    with server.client() as c:
        jid = c.post("/api/jobs", json={"name": "tuned"}).json()["id"]
        assert agent.post(f"/api/agents/{aid}/claim").json()["job_id"] == jid
        measured = [{"row_len": 256, "rows": 16, "tokens_per_s": 9000.0, "fits": True},
                    {"row_len": 512, "rows": 8, "tokens_per_s": 7000.0, "fits": True}]
        agent.post(f"/api/agents/{aid}/events", json={"events": [
            {"kind": "info", "job_id": jid, "seq": 0, "t": time.time(),
             "data": {"batch_size": 16, "row_len": 256, "max_seq_length": 256,
                      "measured": measured}}]}).raise_for_status()
        r = c.post("/api/jobs", json={"batch_size": 1, "max_seq_length": 256}).json()
        bw = [w for w in r["warnings"] if w["kind"] == "batch_size"]
        assert bw and f"job #{jid} measured 16 rows of 256 tokens fastest" in bw[0]["message"], r["warnings"]
        assert bw[0]["fix"].startswith("batch_size=16")
        r = c.post("/api/jobs", json={"batch_size": 12, "max_seq_length": 256}).json()
        assert not [w for w in r["warnings"] if w["kind"] == "batch_size"], r["warnings"]


def test_a_slow_analysis_does_not_hold_the_submit_and_serves_the_next_one(server_factory):
    """Past preflight_wait_s the submit answers at once ("pending"); the analysis goes on in the
    background and a later submit of the same settings gets its warnings from the cache."""
    from conftest import wait_for
    s = server_factory(preflight_wait_s=0.001)
    with s.client() as c:
        first = c.post("/api/jobs", json={"max_seq_length": 40}).json()
        assert first["preflight"]["analysis"] == "pending" and first["warnings"] == [], first["preflight"]
        assert first["preflight"]["seconds"] < 5
        later = wait_for(lambda: (lambda r: r if r["preflight"]["analysis"] == "cached" else None)(
            c.post("/api/jobs", json={"max_seq_length": 40}).json()), 300, "the cached analysis", every=3)
        assert [w["kind"] for w in later["warnings"]] == ["truncation"], later["warnings"]
