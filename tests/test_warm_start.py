"""Warm start (worker/agent/warm.py, worker/agent/zygote.py, worker/training/zygote.py): a real server
and agent; the agent's zygote imports once and forks a standby per job, which trains exactly as a
plain start of the same spec does (same seed, same losses) and shows itself as a training process
with its job's tag; a torchrun job starts plainly and says so; a job whose zygote died starts
plainly, saying why, and a new zygote follows; a survivor of a warm attempt is killed before the next
attempt; the zygote, a running job's keeper and its training process die with an agent killed -9.
Beside it, the earlier-attempt check of tree.py on real processes carrying a warm standby's tag."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, wait_for

from worker.agent.keeper import AGENT_PID_ENV, TAG_ENV
from worker.agent.tree import JobTree, job_tag

SPEC = {"name": "warm", "max_steps": 4, "device": "cpu", "precision": "fp32", "batch_size": 2, "grad_accum": 1,
        "max_seq_length": 64, "seed": 11, "test_run": False}


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def processes(agent_pid: int, needle: bytes) -> list[int]:
    """The agent's live processes whose command line holds needle (its zygote's forks carry the
    agent's pid in the environment they started with)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmd and b"keeper.py" not in cmd and environ(int(d.name)).get(AGENT_PID_ENV) == str(agent_pid) \
                and alive(int(d.name)):
            found.append(int(d.name))
    return found


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def log_lines(c, job_id: int) -> list[str]:
    events = c.get(f"/api/jobs/{job_id}/events", params={"limit": 100_000, "kind": "log"}).json()["events"]
    return [e["data"].get("line") or json.dumps(e["data"]) for e in events]


def losses(c, job_id: int) -> list[float]:
    s = c.get(f"/api/jobs/{job_id}/metrics", params={"keys": "loss", "max_points": 100000}).json()["series"]["loss"]
    return [v for _, v in sorted(zip(s["step"], s["value"]))]


def plain_losses(spec: Path, out: Path, cache: Path) -> list[float]:
    """The same spec in a training process started plainly, as child.py starts one."""
    r, w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-u", "-m", "worker.training.train", "--spec", str(spec),
                             "--out", str(out), "--cache-dir", str(cache)], cwd=ROOT, pass_fds=(w,),
                            env={**os.environ, "TOKENPULSE_EVENT_FD": str(w), "PYTHONFAULTHANDLER": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    os.close(w)
    with os.fdopen(r) as f:
        events = [json.loads(line) for line in f]
    assert proc.wait(120) == 0, proc.stderr.read()[-3000:]
    return [e["data"]["values"]["loss"] for e in events if e["kind"] == "metrics" and "loss" in e["data"]["values"]]


def test_a_warm_job_trains_as_a_plain_one_forked_from_the_zygote_which_dies_with_its_agent(server, tmp_path):
    agent = server.start_agent("w", env={"TOKENPULSE_WARM_START": "1"})  # the suite's start on the first claim
    work = server.data_dir.parent / "work-w"
    zygote = wait_for(lambda: processes(agent.pid, b"worker.training.zygote"), 120, "the agent's zygote")[0]
    with server.client() as c:
        job = c.post("/api/jobs", json={**SPEC, "max_steps": 40,
                                        "name": server.plan_fault("w", step_sleep_s=0.2)}).json()["id"]
        # its training process: forked (the zygote its keeper's parent), shown as what it is, tagged
        trainer = wait_for(lambda: processes(agent.pid, b"worker.training.train\0--spec"), 120, "the job's process")[0]
        assert parent(parent(trainer)) == zygote
        assert f"/jobs/{job}/spec.json" in Path(f"/proc/{trainer}/cmdline").read_text()
        attempt, tag = (work / "jobs" / str(job) / "warm_tags").read_text().split()
        assert attempt == "1" and environ(trainer)[TAG_ENV] == tag and tag.startswith("warm") and tag.endswith("#0")
        assert server.wait_job(job, timeout=300)["state"] == "completed"
        assert any(f"started warm: in standby pid {trainer}, forked from the agent's zygote (pid {zygote})" in line
                   for line in log_lines(c, job))
        same = c.post("/api/jobs", json=SPEC).json()["id"]
        assert server.wait_job(same, timeout=300)["state"] == "completed"
        warm = losses(c, same)
        assert len(warm) == 4
        assert plain_losses(work / "jobs" / str(same) / "spec.json", tmp_path / "plain", work / "cache") == \
            pytest.approx(warm, rel=1e-6)

        # a torchrun job starts plainly and says so
        gang = c.post("/api/jobs", json={**SPEC, "name": "gang", "nproc_per_node": 2}).json()["id"]
        said = wait_for(lambda: [x for x in log_lines(c, gang) if "started plainly" in x], 120,
                        "the gang's start line")
        assert "a distributed job: torchrun starts its ranks" in said[0]
        assert c.post(f"/api/jobs/{gang}/cancel").status_code == 200
        assert server.wait_job(gang, timeout=120)["state"] == "cancelled"

        # a warm-started attempt's survivor (a process with its standby's tag, as a forked worker of it
        # has) is killed before the job's next attempt starts: the job's warm record names that tag
        retried = c.post("/api/jobs", json={**SPEC, "max_steps": 20, "max_retries": 1, "name": server.plan_fault(
            "retried", crash_at_step=3, step_sleep_s=0.3)}).json()["id"]
        record = work / "jobs" / str(retried) / "warm_tags"
        tag = wait_for(lambda: record.exists() and record.read_text().split(), 120, "attempt 1 started warm")[1]
        survivor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                    env={**os.environ, TAG_ENV: tag})
        try:
            assert server.wait_job(retried, timeout=300)["state"] == "failed"  # the fault crashes each attempt
            assert survivor.wait(10) == -signal.SIGKILL
            assert any(f"processes of an earlier attempt of this job still running here (pids [{survivor.pid}" in x
                       for x in log_lines(c, retried))
        finally:
            survivor.kill()

        # the zygote killed: the next job starts plainly, says why, completes; a new zygote follows
        os.kill(zygote, signal.SIGKILL)
        wait_for(lambda: not alive(zygote), 30, "the zygote killed")
        plain = c.post("/api/jobs", json={**SPEC, "name": "after", "max_steps": 2}).json()["id"]
        assert server.wait_job(plain, timeout=300)["state"] == "completed"
        assert any("started plainly: its zygote ended" in x for x in log_lines(c, plain)), log_lines(c, plain)[:5]
        zygote = wait_for(lambda: processes(agent.pid, b"worker.training.zygote"), 120, "a new zygote")[0]
        running = c.post("/api/jobs", json={**SPEC, "max_steps": 400, "name": server.plan_fault(
            "long", step_sleep_s=0.5)}).json()["id"]
        wait_for(lambda: c.get(f"/api/jobs/{running}").json()["state"] == "running", 120, "the last job running")
        trainer = wait_for(lambda: processes(agent.pid, b"worker.training.train\0--spec"), 120, "its process")[0]
        keeper = parent(trainer)

    # the agent killed -9: the zygote dies with it, and the running job's keeper kills its tree and goes
    agent.send_signal(signal.SIGKILL)
    agent.wait(30)
    wait_for(lambda: not any(map(alive, (zygote, keeper, trainer))), 30, "the zygote and the job gone with the agent")


def test_a_warm_attempts_survivors_are_killed_before_the_next_attempt(tmp_path):
    """tree.py finds an earlier attempt's processes by the standby tag the job's warm record names;
    an unassigned standby's and this attempt's own stay."""
    job = job_tag("http://127.0.0.1:1", 5)
    record = tmp_path / "warm_tags"
    survivor_tag, own_tag, idle_tag = (f"warm1.{n}-{job_tag('http://127.0.0.1:1', 0)}#0" for n in (1, 2, 3))
    record.write_text(f"1 {survivor_tag}\n2 {own_tag}\n")

    def sleeper(tag: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                env={**os.environ, TAG_ENV: tag})
    procs = {tag: sleeper(tag) for tag in (survivor_tag, own_tag, idle_tag)}
    try:
        wait_for(lambda: all(environ(p.pid).get(TAG_ENV) == t for t, p in procs.items()), 30, "the sleepers")
        tree = JobTree(job, job_id=5, attempt=2, warm_record=record)
        tree.prepare()
        assert tree.settled == [procs[survivor_tag].pid]
        assert procs[survivor_tag].wait(10) == -signal.SIGKILL
        assert procs[own_tag].poll() is None and procs[idle_tag].poll() is None
        tree.release()
    finally:
        for p in procs.values():
            p.kill()
            p.wait()

