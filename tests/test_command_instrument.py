"""End to end: an unchanged Hugging Face Trainer script run as a command job by a real agent, with
the zero-code instrumentation the agent injects: metrics stored, pause then resume at the same
step, and a blocked step raising a stalled alert naming the script's line."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import ROOT, command_agent_server, wait_for
from test_instrument import SCRIPTS, tiny_model  # noqa: F401  (the module-scoped model fixture)

PY = sys.executable
SCRIPT = SCRIPTS / "hf_trainer.py"
SLEEP_LINE = next(i for i, line in enumerate(SCRIPT.read_text().splitlines(), 1) if "time.sleep(3600)" in line)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """One server and one command agent for the module: each test checks only the job it submitted."""
    yield from command_agent_server(tmp_path_factory, "command-instrument")


def submit(c, tiny_model: Path, tmp: Path, *args: str, **spec) -> int:
    command = [PY, str(SCRIPT), "--model", str(tiny_model), "--data", str(ROOT / "tokenpulse" / "demo" / "demo.jsonl"),
               "--out", str(tmp / "out"), *args]
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp / "hf-datasets"), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(ROOT)}
    r = c.post("/api/jobs/command", json={"command": command, "cwd": str(tmp), "env": env, **spec})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def series(c, job_id: int, key: str) -> dict:
    return c.get(f"/api/jobs/{job_id}/metrics", params={"keys": [key]}).json()["series"].get(key) or {"step": []}


def test_trainer_command_job_reports_pauses_and_resumes_at_the_same_step(srv, tiny_model, tmp_path):  # noqa: F811
    with srv.client() as c:
        job_id = submit(c, tiny_model, tmp_path, "--max-steps", "60", "--step-sleep", "0.3", "--eval-steps", "3")
        wait_for(lambda: len(series(c, job_id, "eval/loss")["step"]) >= 1, 240, "an eval loss",
                 show=lambda: c.get(f"/api/jobs/{job_id}").json())
        for key in ("loss", "lr", "grad_norm", "tokens_per_s", "padded_tokens_per_s", "samples_per_s"):
            assert series(c, job_id, key)["step"], key
        job = c.get(f"/api/jobs/{job_id}").json()
        assert job["info"].get("pausable") is True, job["info"]
        assert c.post(f"/api/jobs/{job_id}/pause").status_code == 200
        job = srv.wait_job(job_id, states=("paused", "failed", "completed", "cancelled"), timeout=120)
        assert job["state"] == "paused", job
        ckpt = job["checkpoint"]
        step = int(Path(ckpt).name.split("-")[1])
        assert Path(ckpt).is_dir() and step == max(series(c, job_id, "loss")["step"])

        assert c.post(f"/api/jobs/{job_id}/resume").status_code == 200
        wait_for(lambda: max(series(c, job_id, "loss")["step"]) > step + 1, 240, "steps after the resume",
                 show=lambda: c.get(f"/api/jobs/{job_id}").json())
        events = c.get(f"/api/jobs/{job_id}/events",
                       params={"kinds": ["info", "phase"], "limit": 10000}).json()["events"]
        resumed = next(i for i, e in enumerate(events) if e["data"].get("resumed_from") == ckpt)
        first = next(e["data"] for e in events[resumed:] if e["kind"] == "phase" and e["data"]["name"] == "training")
        assert first["done"] == step, first  # the resumed attempt starts where the pause saved
        assert min(s for s in series(c, job_id, "loss")["step"] if s > step) == step + 1
        assert c.post(f"/api/jobs/{job_id}/cancel").status_code == 200
        assert srv.wait_job(job_id, timeout=120)["state"] == "cancelled"


def test_a_blocked_trainer_step_raises_a_stalled_alert_naming_the_script_line(srv, tiny_model, tmp_path):  # noqa: F811
    with srv.client() as c:
        job_id = submit(c, tiny_model, tmp_path, "--max-steps", "60", "--block-at-step", "4",
                        # the hook sees steps 1-3 (the script's callback blocks step 4 before it): two
                        # intervals, short of the three a learned timeout needs, so the first-step
                        # allowance is what the blocked step waits out
                        stall={"floor_s": 5, "factor": 3, "first_step_s": 20, "phase_s": 120})

        def stalled():
            alerts = c.get("/api/alerts", params={"job_id": job_id}).json()
            return next((a for a in alerts if a["kind"] == "stalled"), None)
        alert = wait_for(stalled, 300, "a stalled alert", show=lambda: c.get(f"/api/jobs/{job_id}").json())
        assert f"hf_trainer.py:{SLEEP_LINE}" in alert["message"] or f"line {SLEEP_LINE}" in alert["message"], alert
        assert "on_step_end" in alert["stack"], alert["stack"][:2000]
        assert c.post(f"/api/jobs/{job_id}/cancel").status_code == 200
        assert srv.wait_job(job_id, timeout=120)["state"] == "cancelled"
