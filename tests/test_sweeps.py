"""Sweeps: bad input refused naming the field; a real sweep on a real agent (tiny demo jobs) that
prunes a hopeless trial, survives a kill -9 of its server, and counts a trial that never reports
the objective as failed."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, wait_for

PY = sys.executable
BASE = dict(batch_size=2, grad_accum=1, max_seq_length=64, precision="fp32", device="cpu", seed=3, log_every=1,
            max_steps=16)
SWEEP = {"base": BASE, "objective": {"metric": "loss"},
         "parameters": {"learning_rate": {"low": 1e-5, "high": 1e-2, "log": True}}}


def refused(c, body: dict, field: str, words: str = "") -> None:
    r = c.post("/api/sweeps", json=body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert detail["field"] == field, detail
    assert words in detail["message"], detail


@pytest.mark.shared_server
def test_bad_sweeps_are_refused_naming_the_field(server):
    with server.client() as c:
        refused(c, {**SWEEP, "parameters": {}}, "parameters", "empty")
        refused(c, {**SWEEP, "parameters": {"learning_rate": {"low": 0, "high": 1e-2, "log": True}}},
                "parameters.learning_rate", "above zero")
        refused(c, {**SWEEP, "parameters": {"learning_rat": {"values": [1, 2]}}}, "parameters.learning_rat",
                "no setting")
        refused(c, {**SWEEP, "parameters": {"learning_rate": {"low": 1e-3, "high": 2}}}, "parameters.learning_rate",
                "2.0 makes no valid job")
        refused(c, {**SWEEP, "objective": {"metric": "eval/loss"}}, "objective.metric", "no evaluation set")
        refused(c, {**SWEEP, "objective": {"metric": "accuracy"}}, "objective.metric", "no trial reports")
        refused(c, {**SWEEP, "method": "grid"}, "parameters.learning_rate", "grid")
        refused(c, {**SWEEP, "base": {**BASE, "max_steps": 0}}, "base.max_steps")
        refused(c, {**SWEEP, "base": {"command": ["python", "train.py", "--lr", "1e-3"]}},
                "parameters.learning_rate", "{learning_rate}")


def sweep_of(c, sweep_id: int) -> dict:
    return c.get(f"/api/sweeps/{sweep_id}").json()


def test_a_sweep_prunes_a_hopeless_trial_and_survives_a_kill_9(agent_server, tmp_path):
    """Grid over three learning rates, one trial at a time; seed 1 visits 3e-3 first (Optuna's grid
    order for this seed), so the two tiny rates trail its loss and the median pruner stops them."""
    srv = agent_server
    srv.plan_fault("*", step_sleep_s=0.4)  # the demo's steps take ms: slowed, a prune can land mid-run
    spec = tmp_path / "sweep.yaml"
    spec.write_text(
        "name: lr\nproject: search\ntags: [lean]\nmethod: grid\nseed: 1\n"
        f"base: {BASE}\n"
        "parameters:\n  learning_rate: {values: [0.003, 1.0e-6, 3.0e-7]}\n"
        "objective: {metric: loss, goal: min}\nbudget: {trials: 3, parallel: 1}\n"
        "pruner: {kind: median, startup_trials: 1, warmup_steps: 3}\n")
    out = subprocess.run([PY, "-m", "tokenpulse.cli", "--url", srv.url, "sweep", str(spec)], capture_output=True,
                         text=True, cwd=ROOT, env={**srv.env, "TOKENPULSE_TOKEN": srv.token}, timeout=120)
    assert out.returncode == 0, out.stderr
    sweep_id = int(out.stdout.split("sweep ")[1].split()[0])
    with srv.client() as c:
        first = wait_for(lambda: sweep_of(c, sweep_id)["trials"], 60, "the first trial")[0]
        assert first["params"] == {"learning_rate": 0.003}
        job = c.get(f"/api/jobs/{first['job_id']}").json()
        assert job["project"] == "search" and set(job["tags"]) == {"lean", f"sweep:{sweep_id}"}
        assert job["spec"]["learning_rate"] == 0.003 and job["sweep_id"] == sweep_id
        # the second trial running: the server dies mid-sweep, without a chance to tidy up
        wait_for(lambda: len(sweep_of(c, sweep_id)["trials"]) == 2, 300, "the second trial",
                 show=lambda: sweep_of(c, sweep_id))
    srv.kill(signal.SIGKILL)
    srv.start()
    with srv.client() as c:
        done = wait_for(lambda: (s := sweep_of(c, sweep_id))["state"] == "completed" and s, 400,
                        "the sweep to finish", show=lambda: sweep_of(c, sweep_id))
        trials = done["trials"]
        assert [t["number"] for t in trials] == [0, 1, 2]  # none lost, none twice
        jobs = c.get("/api/jobs", params={"sweep_id": sweep_id}).json()["jobs"]
        assert sorted(j["id"] for j in jobs) == sorted(t["job_id"] for t in trials)
        assert trials[0]["state"] == "complete" and done["best"]["number"] == 0
        assert done["best"]["value"] == trials[0]["value"] < 20
        pruned = [t for t in trials if t["state"] == "pruned"]
        assert pruned, trials
        for t in pruned:
            assert 3 <= t["pruned_step"] <= 16 and "pruned at step" in t["reason"], t
            assert c.get(f"/api/jobs/{t['job_id']}").json()["state"] == "cancelled"
        assert min(t["pruned_step"] for t in pruned) < 16 and done["saved_hours"] > 0  # stopped early
        assert set(c.get(f"/api/sweeps/{sweep_id}/importance").json()["importance"]) <= {"learning_rate"}
    sweep_page_in_the_browser(srv, sweep_id, done)


def test_a_trial_that_never_reports_the_objective_fails_and_the_sweep_goes_on(agent_server):
    """grad_norm is reported by training, but a command job that never logs it: each trial is counted
    failed with the reason, and the sweep still runs them all instead of waiting."""
    srv = agent_server
    srv.start_agent("cmd", "--allow-commands")
    body = {"name": "quiet", "base": {"command": [PY, "-c", "import sys; print('lr', sys.argv[1])", "{lr}"]},
            "parameters": {"lr": {"values": [1, 2]}}, "method": "grid", "objective": {"metric": "val/acc"},
            "budget": {"trials": 2, "parallel": 2}}
    with srv.client() as c:
        sweep_id = c.post("/api/sweeps", json=body).json()["id"]
        done = wait_for(lambda: (s := sweep_of(c, sweep_id))["state"] == "completed" and s, 240,
                        "the sweep to finish", show=lambda: sweep_of(c, sweep_id))
    assert [t["state"] for t in done["trials"]] == ["failed", "failed"]
    assert all("without reporting val/acc" in t["reason"] for t in done["trials"])
    assert done["best"] is None


def sweep_page_in_the_browser(srv, sweep_id: int, done: dict) -> None:
    """The finished sweep's page shows what the API says; the jobs list groups trials by project;
    the new-sweep form answers a bad space with the field."""
    from test_ui import CHROMEDRIVER, CHROMIUM, console_errors, login, make_driver, shot, text, until
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        return
    from selenium.webdriver.common.by import By
    d = make_driver()
    try:
        login(d, srv)
        d.get(f"{srv.url}/sweeps/{sweep_id}")
        until(d, 30, lambda d: d.execute_script("return document.body.dataset.rendered") == "3", "the sweep page")
        rows = d.find_elements(By.CSS_SELECTOR, "#trials tr")
        assert [r.get_attribute("data-trial") for r in rows] == ["0", "1", "2"]
        assert "trial-best" in rows[0].get_attribute("class")
        # the trials the API says were pruned (which of #1 and #2 depends on where the server's kill fell)
        assert all("pruned" in rows[t["number"]].text for t in done["trials"] if t["state"] == "pruned")
        assert f"#{done['best']['number']}" in text(d, "#best") and text(d, "#sweep-state") == "completed"
        assert d.find_elements(By.CSS_SELECTOR, "#parallel polyline")
        assert d.find_elements(By.CSS_SELECTOR, "#over-trials circle")
        assert d.find_element(By.ID, "sweep-pause").get_attribute("hidden") is not None  # over: nothing to pause
        shot(d, "sweep-page", full=True)
        d.get(f"{srv.url}/?group=project")
        until(d, 30, lambda d: d.find_elements(By.CSS_SELECTOR, "tr.group-head"), "the jobs grouped by project")
        assert any("search · 3" in h.text for h in d.find_elements(By.CSS_SELECTOR, "tr.group-head"))
        shot(d, "jobs-by-project")
        d.get(f"{srv.url}/sweeps")
        until(d, 30, lambda d: d.find_elements(By.CSS_SELECTOR, f"tr[data-sweep='{sweep_id}']"), "the sweeps list")
        assert not console_errors(d)
        space = d.find_element(By.ID, "sweep-space")
        space.clear()
        space.send_keys("{}")
        d.find_element(By.CSS_SELECTOR, "#sweep-form button[type=submit]").click()
        until(d, 30, lambda d: text(d, "#sweep-error").startswith("parameters"), "the form's refusal naming the field")
    finally:
        d.quit()


def test_a_trials_padding_verdict_is_applied_to_the_remaining_trials(agent_server):
    """Trial 0 pads to max_length: its verdict shows once on the sweep with its cost; applied for the
    sweep, the next trial starts with the fixed settings (the searched one stays the sweep's)."""
    srv = agent_server
    srv.plan_fault("*", step_sleep_s=0.3)  # trial 0 still running when its verdict is offered
    body = {"base": {**BASE, "max_steps": 40, "padding": "max_length", "max_seq_length": 128},
            "parameters": {"learning_rate": {"values": [1e-3, 2e-3]}}, "method": "grid",
            "objective": {"metric": "loss"}, "budget": {"trials": 2, "parallel": 1}, "pruner": {"kind": "none"}}
    with srv.client() as c:
        sweep_id = c.post("/api/sweeps", json=body).json()["id"]
        s = wait_for(lambda: (s := sweep_of(c, sweep_id))["fixes"] and s, 120, "the padding verdict on the sweep",
                     show=lambda: sweep_of(c, sweep_id))
        fix = s["fixes"][0]
        assert fix["kind"] == "padding" and fix["changes"]["padding"] == ["max_length", "auto"], fix
        assert s["lost_hours"]["padding"] > 0
        r = c.post(f"/api/sweeps/{sweep_id}/fix", json={"alert_id": fix["alert_id"], "n": fix["n"]})
        assert r.status_code == 200, r.text
        applied = r.json()["applied"]
        assert applied["padding"] == "auto" and "learning_rate" not in applied
        c.post(f"/api/jobs/{s['trials'][0]['job_id']}/cancel")  # the next trial starts now
        second = wait_for(lambda: len(t := sweep_of(c, sweep_id)["trials"]) == 2 and t[1], 120, "the second trial")
        spec = c.get(f"/api/jobs/{second['job_id']}").json()["spec"]
        assert {k: spec[k] for k in applied} == applied and spec["padding"] == "auto"
        assert spec["learning_rate"] == second["params"]["learning_rate"]
        assert c.post(f"/api/sweeps/{sweep_id}/cancel").json()["state"] == "cancelled"
        done = sweep_of(c, sweep_id)
        assert [t["state"] for t in done["trials"]] == ["failed", "failed"], done["trials"]
        assert "cancelled" in done["trials"][1]["reason"]
