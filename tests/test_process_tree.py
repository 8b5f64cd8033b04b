"""The whole process tree of a job dies with its cancel, its end and its agent (issue 25, item 22),
and a retry never starts while a process of the attempt before it lives. Real server, real agents,
a real `sh wrapped.sh` that starts a quiet python child, a child that calls setsid() and a
double-forked daemon; in the attempt's cgroup (cgroup v2 as root, where this machine has it) and in
the keeper's subreaper alone (TOKENPULSE_JOB_CGROUPS=0)."""
from __future__ import annotations

import json
import os
import signal
import textwrap
from pathlib import Path

import pytest
from conftest import wait_for

from worker.agent.tree import JobTree, cgroup_base

WRAPPED = """\
#!/bin/sh
# $1: where to write; $2: run (wait for the children) or exit (leave them behind)
python check.py "$1"
python quiet.py "$1" quiet &
python setsid_child.py "$1" setsid &
python daemon.py "$1" daemon
until [ -f "$1/quiet.pid" ] && [ -f "$1/setsid.pid" ] && [ -f "$1/daemon.pid" ]; do sleep 0.05; done
echo started
if [ "$2" = exit ]; then exit 0; fi
wait
"""
CHECK = """
import json, os, sys
from pathlib import Path
d = Path(sys.argv[1])
def alive(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False
pids = [int(p.read_text()) for p in d.glob("*.pid")]
with open(d / "checks", "a") as f:  # what of the attempt before still ran when this one started
    f.write(json.dumps([p for p in pids if alive(p)]) + "\\n")
for p in d.glob("*.pid"):
    p.unlink()
(d / "sh.pid").write_text(str(os.getppid()))
"""
QUIET = """
import os, sys, time
open(os.path.join(sys.argv[1], sys.argv[2] + ".pid"), "w").write(str(os.getpid()))
time.sleep(1000)
"""
SETSID = """
import os, sys, time
os.setsid()  # its own session and group: a kill of the job's group misses it
open(os.path.join(sys.argv[1], sys.argv[2] + ".pid"), "w").write(str(os.getpid()))
time.sleep(1000)
"""
DAEMON = """
import os, sys, time
if os.fork():
    os._exit(0)
os.setsid()
if os.fork():
    os._exit(0)  # the grandchild is an orphan: its parent is gone, its session its own
devnull = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(devnull, fd)
open(os.path.join(sys.argv[1], sys.argv[2] + ".pid"), "w").write(str(os.getpid()))
time.sleep(1000)
"""
NAMES = ("sh", "quiet", "setsid", "daemon")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def pids(d: Path) -> dict[str, int]:
    out = {}
    for name in NAMES:
        try:
            out[name] = int((d / f"{name}.pid").read_text())
        except (OSError, ValueError):
            pass
    return out


def started(d: Path) -> dict[str, int]:
    return wait_for(lambda: (lambda p: p if len(p) == len(NAMES) else None)(pids(d)), 60, "the tree to start",
                    show=lambda: pids(d))


def all_dead(got: dict[str, int], within: float, what: str) -> None:
    wait_for(lambda: not any(alive(p) for p in got.values()), within, what,
             show=lambda: {n: p for n, p in got.items() if alive(p)})


@pytest.fixture(params=["cgroup", "subreaper"])
def mode(request):
    if request.param == "cgroup" and cgroup_base() is None:
        pytest.skip("no writable cgroup v2 here (needs root): the subreaper case covers this machine")
    return request.param


def test_the_whole_tree_dies_with_cancel_end_and_agent_and_no_retry_runs_beside_it(server_factory, tmp_path, mode):
    proj = tmp_path / "proj"
    proj.mkdir()
    for name, code in (("wrapped.sh", WRAPPED), ("check.py", CHECK), ("quiet.py", QUIET),
                       ("setsid_child.py", SETSID), ("daemon.py", DAEMON)):
        (proj / name).write_text(textwrap.dedent(code))
    env = {"TOKENPULSE_JOB_CGROUPS": "1" if mode == "cgroup" else "0"}
    srv = server_factory(agent_lost_after_s=3, reaper_every_s=0.5)
    agent = srv.start_agent("a1", "--allow-commands", env=env)

    def job(d: Path, how: str, retries: int = 0) -> int:
        d.mkdir()
        r = c.post("/api/jobs/command", json={"command": ["sh", "wrapped.sh", str(d), how], "cwd": str(proj),
                                               "instrument": False, "max_retries": retries})
        assert r.status_code == 201, r.text
        return r.json()["id"]

    with srv.client() as c:
        # cancel: SIGTERM to the group, then (the setsid child and the daemon are not in it) the tree
        d = proj / "cancelled"
        jid = job(d, "run")
        got = started(d)
        assert c.post(f"/api/jobs/{jid}/cancel").status_code == 200
        assert srv.wait_job(jid, timeout=60)["state"] == "cancelled"
        all_dead(got, 10, "the cancelled job's tree to die")

        # the end: the shell exits 0 and leaves its children running; the job is over, so are they
        d = proj / "ended"
        jid = job(d, "exit")
        got = started(d)
        assert srv.wait_job(jid, timeout=60)["state"] == "completed"
        all_dead(got, 10, "the ended job's tree to die")

        # kill -9 of the agent: its keeper kills the tree at once (well within the lease)
        d = proj / "orphaned"
        jid = job(d, "run", retries=2)
        stem = JobTree.for_job(srv.url.rstrip("/"), jid, 0).cgroup_stem  # this server's job, not another's
        got = started(d)
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        all_dead(got, 5, "the tree of the killed agent's job to die")

        # the agent and the job's keeper both killed: the tree survives them, and the retry's agent
        # on this machine kills it before it starts the next attempt
        agent = srv.start_agent("a2", "--allow-commands", env=env)
        wait_for(lambda: c.get(f"/api/jobs/{jid}").json()["attempt"] == 2 and len(pids(d)) == len(NAMES)
                 and pids(d) != got, 60, "the retry to start its tree")
        got = pids(d)
        keeper = int(Path(f"/proc/{got['sh']}/stat").read_text().rsplit(")", 1)[1].split()[1])
        os.kill(keeper, signal.SIGKILL)
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        wait_for(lambda: not alive(got["sh"]), 10, "the shell to die with its keeper")
        survivors = {n: p for n, p in got.items() if alive(p)}
        assert survivors, "nothing outlived the keeper: this case tests nothing"
        srv.start_agent("a3", "--allow-commands", env=env)
        wait_for(lambda: c.get(f"/api/jobs/{jid}").json()["attempt"] == 3 and len(pids(d)) == len(NAMES)
                 and pids(d) != got, 60, "the third attempt to start")
        checks = [json.loads(x) for x in (d / "checks").read_text().splitlines()]
        assert checks == [[], [], []], checks  # no attempt started beside a process of the one before
        assert not any(alive(p) for p in survivors.values()), survivors
        if mode == "cgroup":  # an agent's first act: the cgroups of agents that died on this machine
            # (a3's, or on a shared machine another test's agent that started first: any agent's log of this run)
            run = next(p for p in tmp_path.parents if p.name.startswith("pytest-") and "-of-" not in p.name)
            wait_for(lambda: any(f"left in {stem}-a2-" in log.read_text(errors="replace")
                                 for log in run.rglob("agent-*.log")), 30, "an agent to say it emptied a2's cgroup")
        else:  # found by the tag in their environment, before the attempt started
            wait_for(lambda: any("processes of an earlier attempt" in e["data"]["line"] for e in c.get(
                f"/api/jobs/{jid}/events", params={"kinds": "log", "limit": 1000}).json()["events"]), 30,
                "the job's log to say what was killed before the attempt started")
        got = pids(d)
        assert c.post(f"/api/jobs/{jid}/cancel").status_code == 200
        srv.wait_job(jid, timeout=60)
        all_dead(got, 10, "the last attempt's tree to die")
        if mode == "cgroup":  # every attempt's cgroup is gone with it
            wait_for(lambda: not list(cgroup_base().glob(f"{stem}-*")), 30, "the cgroups to go",
                     show=lambda: list(cgroup_base().glob(f"{stem}-*")))
