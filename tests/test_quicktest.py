"""A quick test run first (issue 15 item 4): `test_run` / `tokenpulse submit --test` runs the whole job
end to end on a few steps before the full run, as its own `test run` phase with each check's result;
a failing check fails the job at once (as a spec error, never retried) naming the check. Real
server, agent and training processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT

FAST = {"batch_size": 2, "grad_accum": 1, "precision": "fp32", "max_seq_length": 256, "seed": 1}


def events(c, jid, *kinds):
    return c.get(f"/api/jobs/{jid}/events", params={"kinds": list(kinds), "limit": 10000}).json()["events"]


def test_good_spec_passes_the_test_run_then_runs_in_full(agent_server):
    s = agent_server
    with s.client() as c:
        r = c.post("/api/jobs", json={"name": "tested", "max_steps": 6, "eval_fraction": 0.1, "test_run": True, **FAST})
        assert r.status_code == 201, r.text
        job = s.wait_job(r.json()["id"], timeout=400)
        assert job["state"] == "completed" and len(job["attempts"]) == 1, job
        assert job["info"]["test_run"] == "passed"
        checks = {x["check"]: x["ok"] for x in job["info"]["checks"]}
        assert checks == {c_: True for c_ in ("load model", "tokenize a sample", "eval data", "batches", "train",
                                              "checkpoint", "eval", "save", "resume", "reload")}, checks
        evs = events(c, job["id"], "phase", "log")
        phases = [e["data"]["name"] for e in evs if e["kind"] == "phase"]
        assert phases[0] == "test run" and phases.index("training") > max(i for i,
                                                                          p in enumerate(phases) if p == "test run")
        done = [e["data"] for e in evs if e["kind"] == "phase" and e["data"]["name"] == "test run"][-1]
        assert done["done"] == done["total"] == 10 and done["detail"] == "passed"
        log = "\n".join(e["data"]["line"] for e in evs if e["kind"] == "log")
        assert "test run: ok   resume" in log and "test run: ok   reload" in log, log[-3000:]
        # the full run's points, not the test run's: steps 1..6 once each
        loss = c.get(f"/api/jobs/{job['id']}/metrics", params={"keys": ["loss"]}).json()["series"]["loss"]
        assert loss["step"] == [1, 2, 3, 4, 5, 6]
        assert job["output_dir"] and os.path.isdir(job["output_dir"])
        assert not os.path.exists(os.path.join(os.path.dirname(job["output_dir"]), ".test-run"))


def test_broken_eval_file_fails_within_the_test_run_naming_the_check(agent_server, tmp_path):
    """The eval file's first line is fine (so the submit-time check passes), a later one is not JSON:
    the test run fails at 'eval data' in seconds, the job is failed as spec, not retried. Via the CLI."""
    s = agent_server
    bad = tmp_path / "eval.jsonl"
    bad.write_text(json.dumps({"text": "a fine first line"}) + "\n{this is not json\n")
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps({"name": "broken eval", "max_steps": 500, "eval_dataset": str(bad), **FAST}))
    env = {**os.environ, "TOKENPULSE_URL": s.url, "TOKENPULSE_TOKEN": s.token, "COLUMNS": "250"}
    out = subprocess.run([sys.executable, "-m", "tokenpulse.cli", "submit", str(spec), "--test", "--follow"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "failed" in out.stdout and "test run failed at check 'eval data'" in out.stdout, out.stdout
    with s.client() as c:
        job = c.get("/api/jobs", params={"q": "broken eval"}).json()["jobs"][0]
        job = c.get(f"/api/jobs/{job['id']}").json()
        assert job["spec"]["test_run"] is True
        assert job["state"] == "failed" and job["failure"] == "spec" and len(job["attempts"]) == 1, job
        assert job["info"]["test_run"] == "failed" and job["info"]["failed_check"] == "eval data"
        assert "JSON" in job["reason"] or "json" in job["reason"], job["reason"]  # the parse error's own words
        trained = {k for k in c.get(f"/api/jobs/{job['id']}/metrics").json()["series"] if not k.startswith("sys/")}
        assert not trained, trained  # never trained in full (the agent's system samples are not training)
        alerts = c.get("/api/alerts", params={"job_id": job["id"]}).json()
        assert any(a["kind"] == "test_run" and "'eval data'" in a["message"] for a in alerts), alerts
