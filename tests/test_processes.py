"""Process lifecycles: `tokenpulse up` and its family (server, embedded agents, training processes)
stop together; an agent stops promptly even when its server is gone."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time

import httpx
import psutil
from conftest import ROOT, free_port, wait_for


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigterm_to_up_stops_server_agent_and_training_and_requeues_the_job(tmp_path):
    port, data = free_port(), tmp_path / "data"
    log = (tmp_path / "up.log").open("w")
    up = subprocess.Popen([sys.executable, "-m", "tokenpulse.cli", "up", "--data-dir", str(data),
                           "--port", str(port)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: up.poll() is None and (data / "token").exists() and _health(url), 60, "the server")
        token = (data / "token").read_text().strip()
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
            jid = c.post("/api/jobs", json={"max_steps": 5000, "batch_size": 2, "max_seq_length": 64,
                                            "precision": "fp32"}).json()["id"]
            wait_for(lambda: (c.get(f"/api/jobs/{jid}").json().get("step") or 0) >= 2, 120, "training steps")
        family = psutil.Process(up.pid).children(recursive=True)
        names = [" ".join(p.cmdline()) for p in family]
        assert any(" agent " in n for n in names) and any("worker.training.train" in n for n in names), names
        up.send_signal(signal.SIGTERM)
        assert up.wait(150) == 0, (tmp_path / "up.log").read_text()[-3000:]
        wait_for(lambda: not any(alive(p.pid) for p in family), 30, "the whole family to exit",
                 show=lambda: [(p.pid, " ".join(p.cmdline())) for p in family if alive(p.pid)])
        # the agent stopped while the server still listened: its job checkpointed and went back to the queue
        with sqlite3.connect(data / "tokenpulse.db") as db:
            assert db.execute("select state from jobs where id=?", (jid,)).fetchone()[0] == "queued"
    finally:
        if up.poll() is None:
            for p in psutil.Process(up.pid).children(recursive=True):
                p.kill()
            up.kill()
            up.wait()


def _health(url: str) -> bool:
    try:
        return httpx.get(f"{url}/api/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_an_agent_stopped_while_its_server_is_down_exits_promptly(server):
    agent = server.start_agent("a1")
    wait_for(lambda: server.client().get("/api/agents").json(), 60, "the agent to register")
    server.kill(signal.SIGKILL)
    agent_log = server.data_dir.parent / "agent-a1.log"
    wait_for(lambda: "retrying" in agent_log.read_text(), 30, "the agent to find its server gone")
    agent.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    agent.wait(30)  # before: the claim loop retried forever, and SIGTERM did nothing
    assert time.monotonic() - t0 < 15


def test_kill9_of_up_stops_its_embedded_agent(tmp_path):
    port, data = free_port(), tmp_path / "data"
    up = subprocess.Popen([sys.executable, "-m", "tokenpulse.cli", "up", "--data-dir", str(data),
                           "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _health(f"http://127.0.0.1:{port}"), 60, "the server")
        agents = wait_for(lambda: [p for p in psutil.Process(up.pid).children() if " agent " in " ".join(p.cmdline())],
                          30, "the embedded agent")
        up.kill()
        up.wait()
        # SIGTERM from the kernel; with no server to talk to it exits at once
        wait_for(lambda: not alive(agents[0].pid), 30, "the orphaned agent to exit")
    finally:
        if up.poll() is None:
            up.kill()
        for p in psutil.process_iter():
            try:
                if str(data) in " ".join(p.cmdline()):
                    p.kill()
            except psutil.Error:
                pass
