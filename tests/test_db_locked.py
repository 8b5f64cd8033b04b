"""A database locked by another process for longer than the busy timeout (a real second process
holding BEGIN EXCLUSIVE on the SQLite file): requests answer 503 with Retry-After, not 500, and the
agents whose heartbeats could not be stored meanwhile are not declared lost."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import wait_for

from tests import pg

pytestmark = pytest.mark.skipif(pg.enabled(), reason="SQLite only: a SQLite file locked by another process")

HOLD = """
import sqlite3, sys, time
con = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
con.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
con.execute("ROLLBACK")
"""


def test_locked_database_answers_503_and_no_agent_is_lost(server_factory):
    lease = 6
    s = server_factory(busy_timeout_s=1, agent_lost_after_s=lease, reaper_every_s=0.5)
    s.start_agent("a1", env={"OMP_NUM_THREADS": "1"})
    with s.client() as c:
        jid = c.post("/api/jobs", json={"max_steps": 5000, "batch_size": 2, "max_seq_length": 64,
                                        "precision": "fp32", "max_retries": 0}).json()["id"]
        wait_for(lambda: (c.get(f"/api/jobs/{jid}").json().get("step") or 0) >= 2, 120, "training steps")
        # held for well over the lease: every heartbeat meanwhile waits out the busy timeout and fails
        holder = subprocess.Popen([sys.executable, "-c", HOLD, str(s.data_dir / "tokenpulse.db"), str(3 * lease)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "locked"
            t0 = time.monotonic()
            r = c.post("/api/jobs", json={"max_steps": 1})
            assert r.status_code == 503, (r.status_code, r.text)  # before: a bare 500
            assert "locked" in r.json()["detail"] and float(r.headers["retry-after"]) > 0
            assert time.monotonic() - t0 < 10
            assert holder.wait(60) == 0
        finally:
            holder.kill()
        agent_log = s.data_dir.parent / "agent-a1.log"
        assert "answered 503" in agent_log.read_text()
        step = c.get(f"/api/jobs/{jid}").json()["step"]
        # the lock is gone: the job goes on under its first attempt, its agent online all along
        wait_for(lambda: c.get(f"/api/jobs/{jid}").json()["step"] >= step + 3, 60, "progress after the lock")
        # a few reaper passes after the stall: still nobody lost (before: lost at the first pass)
        wait_for(lambda: c.get(f"/api/jobs/{jid}").json()["step"] >= step + 6, 60, "more progress")
        job = c.get(f"/api/jobs/{jid}").json()
        assert job["state"] == "running" and job["attempt"] == 1, job
        assert [a["state"] for a in c.get("/api/agents").json()] == ["online"]
        assert not c.get("/api/alerts", params={"job_id": jid, "kind": "worker_lost"}).json()


def test_a_write_stall_restarts_leases_instead_of_losing_agents(tmp_path):
    """Deterministic half of the above: the reaper's pass right after a stall longer than the lease."""
    from sqlalchemy import select
    from sqlalchemy.exc import OperationalError

    from server.db import Database, upgrade_to_head
    from server.models import Agent
    from server.reaper import lease_origin, reap
    path = tmp_path / "r.db"
    url = f"sqlite:///{path}"
    upgrade_to_head(url)
    db = Database(url, busy_timeout_s=0.2)
    try:
        started = time.time() - 100  # the server has run for a while
        db.write_sync(lambda s: s.add(Agent(name="a", host="h", device="cpu", capacity=1, state="online",
                                            created_at=time.time(), seen_at=time.time())))
        lease = 1.0
        holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path), str(3 * lease)],
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "locked"
        try:  # a heartbeat arrives during the lock and cannot be stored
            db.write_sync(lambda s: s.execute(Agent.__table__.update().values(seen_at=time.time())))
            raise AssertionError("the write went through a held exclusive lock")
        except OperationalError as e:
            assert "locked" in str(e)
        assert holder.wait(30) == 0
        assert db.write_sync(lambda s: reap(s, lease, lease_origin(db, started))) == []
        assert db.write_sync(lambda s: s.scalars(select(Agent.state)).one()) == "online"
        assert db.write_sync(lambda s: reap(s, lease, started))  # without the stall's grace: lost
    finally:
        db.close()


def test_reads_past_a_long_foreign_lock_neither_end_the_stall_nor_lose_agents_nor_clear_the_outage(tmp_path):
    """Issue 25, items 20 and 23, deterministically: during another process's write lock three
    leases long, the reaper's passes keep going through (they only read when nobody is due), which
    used to end the stall: the outage cleared every pass and reopened at the next failed write, and a
    lease after such a read the agent whose heartbeats could not be stored was declared lost. Now
    only a write ends a stall: nobody is lost, the outage stays open, and it clears once a write
    went through after the lock."""
    import sqlite3

    from sqlalchemy import select
    from sqlalchemy.exc import OperationalError

    from server.context import App
    from server.db import Database, upgrade_to_head
    from server.hub import Hub
    from server.models import Agent
    from server.reaper import reaper_pass
    from server.settings import Settings
    from server.storage_errors import clear_outages, open_outage
    path = tmp_path / "r.db"
    url = f"sqlite:///{path}"
    upgrade_to_head(url)
    lease = 1.0
    db = Database(url, busy_timeout_s=0.2)
    tp = App(settings=Settings(agent_lost_after_s=lease), db=db, hub=Hub())
    try:
        started = time.time() - 100  # the server has run for a while
        db.write_sync(lambda s: s.add(Agent(name="a", host="h", device="cpu", capacity=1, state="online",
                                            created_at=time.time(), seen_at=time.time())))
        holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path), str(5 * lease)],
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        try:  # a heartbeat cannot be stored: the outage opens
            db.write_sync(lambda s: s.execute(Agent.__table__.update().values(seen_at=time.time())))
            raise AssertionError("the write went through a held exclusive lock")
        except OperationalError as e:
            assert "locked" in str(e)
            open_outage(tp, "locked", "locked")
        reads = 0
        while time.monotonic() - t0 < 3 * lease:  # reaper passes through three leases of the lock
            assert db.write_sync(lambda s: s.scalars(select(Agent.state)).one()) == "online"  # a read goes through
            reads += 1
            assert db.in_stall, "a read-only transaction ended the stall"
            try:
                db.write_sync(lambda s: reaper_pass(s, tp, started))
            except (OperationalError, sqlite3.OperationalError):
                pass  # its write probe waits out the busy timeout and fails: still locked
            clear_outages(tp)
            assert "locked" in db.outages, "the outage cleared while nothing could be written"
        assert reads >= 3 and holder.poll() is None
        assert holder.wait(30) == 0
        # the lock is gone: the next pass writes (its probe), ends the stall, and the outage clears
        assert db.write_sync(lambda s: reaper_pass(s, tp, started)) == []
        assert not db.in_stall
        clear_outages(tp)
        assert not db.outages
        assert db.write_sync(lambda s: s.scalars(select(Agent.state)).one()) == "online"
    finally:
        db.close()
