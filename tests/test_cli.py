"""Every command of README.md's "Using it" section, run as a real subprocess (`python -m
tokenpulse.cli ...`) against a real server (and agent) through TOKENPULSE_URL / TOKENPULSE_TOKEN,
the way a person runs them. (`tokenpulse agent` runs in every fixture that starts an agent.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
from conftest import ROOT, wait_for

# Small and fixed-shape, so the jobs these tests run take seconds on a busy CPU.
QUICK = ["--set", "batch_size=2", "--set", "grad_accum=1", "--set", "max_seq_length=64", "--set", "precision=fp32"]


def cli(server, *args: str, timeout: float = 300, token: str | None = None,
        stdin: str = "") -> subprocess.CompletedProcess:
    env = {**server.env, "TOKENPULSE_URL": server.url, "TOKENPULSE_TOKEN": token or server.token,
           "COLUMNS": "200"}  # rich wraps tables at the terminal width; a pipe has none
    return subprocess.run([sys.executable, "-m", "tokenpulse.cli", *args], env=env, cwd=ROOT,
                          input=stdin, capture_output=True, text=True, timeout=timeout)


def ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout: {r.stdout[-3000:]}\nstderr: {r.stderr[-3000:]}"
    return r.stdout


def job_of(server, jid: int) -> dict:
    with server.client() as c:
        return c.get(f"/api/jobs/{jid}").json()


def test_demo_runs_and_follows_to_the_saved_model(agent_server):
    out = ok(cli(agent_server, "demo", "--steps", "30", timeout=600))
    assert "demo job 1 queued" in out, out
    assert "job 1 completed" in out and "model saved in" in out, out
    job = job_of(agent_server, 1)
    assert job["state"] == "completed" and job["step"] == 30 and job["spec"]["max_steps"] == 30, job


def test_submit_example_with_set_and_follow(agent_server, tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Question {i}?", "response": f"Answer number {i}."}) + "\n"
                            for i in range(64)))
    r = cli(agent_server, "submit", "examples/sft.yaml", "--set", "model=builtin:tiny-llama",
            "--set", f"dataset={data}", "--set", "max_steps=4", "--set", "learning_rate=1e-4", *QUICK, "--follow")
    out = ok(r)
    assert "job 1 (my-sft) queued" in out and "job 1 completed" in out, out
    spec = job_of(agent_server, 1)["spec"]
    assert spec["learning_rate"] == 1e-4 and spec["max_steps"] == 4 and spec["prompt_field"] == "prompt"
    # a bad setting is refused naming the field, with a non-zero exit and nothing queued
    r = cli(agent_server, "submit", "examples/sft.yaml", "--set", "model=builtin:tiny-llama",
            "--set", f"dataset={data}", "--set", "learning_rate=5")
    assert r.returncode == 2 and "error learning_rate" in r.stdout, (r.returncode, r.stdout, r.stderr)
    assert "2" not in [str(j["id"]) for j in httpx.get(f"{agent_server.url}/api/jobs", headers={
        "Authorization": f"Bearer {agent_server.token}"}).json()["jobs"]]


def test_analyze_prints_a_summary_and_json(server, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": "word " * (5 + i % 40)}) + "\n" for i in range(200)))
    out = ok(cli(server, "analyze", "--dataset", str(data)))
    assert "200 examples" in out and "recommended max_seq_length:" in out, out
    for layout in ("max_length", "dynamic", "pack"):
        assert layout in out, out
    a = json.loads(ok(cli(server, "analyze", "--dataset", str(data), "--json")))
    assert a["examples"] == 200 and f"recommended max_seq_length: {a['recommended_max_seq_length']}" in out
    r = cli(server, "analyze", "--dataset", str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and "error dataset" in r.stdout, (r.stdout, r.stderr)


def test_jobs_show_pause_resume_cancel_clone_watch(agent_server):
    s = agent_server
    # a job slow enough to be caught running (test-only fault plan, read by its training process)
    out = ok(cli(s, "submit", "-", *QUICK, "--set", f"name={s.plan_fault('slow', step_sleep_s=0.3)}",
                 stdin="max_steps: 2000\n"))  # a spec on stdin
    assert out.startswith("job 1 (slow) queued"), out
    wait_for(lambda: (job_of(s, 1).get("step") or 0) >= 2, 180, "job 1 training")
    listed = ok(cli(s, "jobs"))
    assert "1 jobs" in listed and "slow" in listed and "running" in listed, listed
    shown = json.loads(ok(cli(s, "show", "1")))
    assert shown["id"] == 1 and shown["spec"]["max_steps"] == 2000

    assert "pause requested" in ok(cli(s, "pause", "1"))
    wait_for(lambda: job_of(s, 1)["state"] == "paused", 120, "job 1 paused")
    assert "job 1: queued" in ok(cli(s, "resume", "1"))
    wait_for(lambda: job_of(s, 1)["state"] == "running" and len(job_of(s, 1)["attempts"]) == 2, 180,
             "job 1 running again")
    attempts = ok(cli(s, "show", "1", "--attempts"))  # issue 33: the attempts, each with its decision
    assert "job 1: attempts" in attempts and "paused" in attempts and "running" in attempts, attempts
    assert "cancel requested" in ok(cli(s, "cancel", "1"))
    wait_for(lambda: job_of(s, 1)["state"] == "cancelled", 120, "job 1 cancelled")
    r = cli(s, "cancel", "1")  # a finished job: a clear refusal, not a silent success
    assert r.returncode == 2 and "cancelled" in r.stdout, (r.stdout, r.stderr)

    out = ok(cli(s, "clone", "1", "--set", "seed=1", "--set", "max_steps=3", "--set", "name=quick"))
    assert "job 2 queued (clone of 1)" in out, out
    clone = job_of(s, 2)
    assert clone["parent_id"] == 1 and clone["spec"]["seed"] == 1 and clone["spec"]["batch_size"] == 2
    watched = ok(cli(s, "watch", "2"))
    assert "job 2 completed" in watched and "model saved in" in watched, watched


def test_tokens_create_list_revoke(server):
    out = ok(cli(server, "tokens", "create", "ci-worker", "--role", "agent"))
    assert "agent token" in out and "(ci-worker)" in out and "shown once" in out, out
    tid, secret = out.split("agent token ")[1].split(" ")[0], out.split("): ")[1].split()[0]
    headers = {"Authorization": f"Bearer {secret}"}
    hello = {"name": "ci", "host": "h", "device": "cpu", "capacity": 1}
    assert httpx.post(f"{server.url}/api/agents", json=hello, headers=headers).status_code < 400
    listed = ok(cli(server, "tokens", "list"))
    assert "ci-worker" in listed and "agent" in listed and secret not in listed, listed
    assert f"token {tid} (ci-worker) revoked" in ok(cli(server, "tokens", "revoke", tid))
    assert httpx.post(f"{server.url}/api/agents", json=hello, headers=headers).status_code == 401


def test_unreachable_server_is_named(tmp_path):
    from conftest import free_port
    env_server = type("S", (), {"env": dict(os.environ), "url": f"http://127.0.0.1:{free_port()}", "token": "x"})
    r = cli(env_server, "jobs", timeout=60)
    assert r.returncode == 2 and "cannot reach tokenpulse" in r.stdout, (r.stdout, r.stderr)
