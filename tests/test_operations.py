"""Operations: Prometheus /metrics, and `tokenpulse db backup` taken while the server runs."""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import httpx
import pytest
from conftest import ROOT
from prometheus_client.parser import text_string_to_metric_families

from tests import pg


def scrape(server) -> dict:
    r = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {server.token}"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def test_metrics_endpoint(server):
    assert httpx.get(f"{server.url}/metrics").status_code == 401  # not public
    with server.client() as c:
        for _ in range(2):
            c.post("/api/jobs", json={"max_steps": 3}).raise_for_status()
        jid = c.post("/api/jobs", json={"max_steps": 3}).json()["id"]
        c.post(f"/api/jobs/{jid}/cancel").raise_for_status()
    with server.ws("jobs"):
        m = scrape(server)
        assert m[("tokenpulse_jobs", (("state", "queued"),))] == 2
        assert m[("tokenpulse_jobs", (("state", "cancelled"),))] == 1
        assert m[("tokenpulse_jobs", (("state", "running"),))] == 0
        assert m[("tokenpulse_websocket_clients", ())] >= 1
        assert ("tokenpulse_write_queue_depth", ()) in m
        assert ("tokenpulse_ingested_points_total", ()) in m
        assert m[("tokenpulse_agents", (("state", "online"),))] == 0
    # an agent stores 3 events, 4 metric points among them (a replay of one is not counted again)
    agent = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.agent_token}"})
    aid = agent.post("/api/agents", json={"name": "a", "host": "h"}).json()["id"]
    claim = agent.post(f"/api/agents/{aid}/claim").json()
    seq, jid = claim["seq_start"], claim["job_id"]
    evs = [{"kind": "metrics", "job_id": jid, "seq": seq, "t": 1.0,
            "data": {"step": 1, "values": {"loss": 2.0, "lr": 0.1}}},
           {"kind": "metrics", "job_id": jid, "seq": seq + 1, "t": 2.0,
            "data": {"step": 2, "values": {"loss": 1.5, "lr": 0.1}}},
           {"kind": "phase", "job_id": jid, "seq": seq + 2, "t": 2.0,
            "data": {"name": "training", "done": 2, "total": 3}}]
    agent.post(f"/api/agents/{aid}/events", json={"events": evs}).raise_for_status()
    agent.post(f"/api/agents/{aid}/events", json={"events": evs[:1]}).raise_for_status()
    m = scrape(server)
    assert m[("tokenpulse_ingested_points_total", ())] == 4
    assert m[("tokenpulse_ingested_events_total", ())] == 3
    assert m[("tokenpulse_agents", (("state", "online"),))] == 1
    assert m[("tokenpulse_jobs", (("state", "running"),))] == 1


def test_db_backup_while_the_server_runs(server, tmp_path):
    if server.on_postgres:
        pytest.skip("the SQLite backup; PostgreSQL's is the pg_dump test below")
    with server.client() as c:
        ids = [c.post("/api/jobs", json={"max_steps": 3, "name": f"j{i}"}).json()["id"] for i in range(5)]
    out = tmp_path / "backups" / "tp.db"
    r = subprocess.run([sys.executable, "-m", "tokenpulse.cli", "db", "backup", str(out),
                        "--data-dir", str(server.data_dir)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "integrity ok" in r.stdout and "5 jobs" in " ".join(r.stdout.split()), r.stdout
    con = sqlite3.connect(out)
    assert [row[0] for row in con.execute("SELECT name FROM jobs ORDER BY id")] == [f"j{i}" for i in range(5)]
    assert con.execute("SELECT version_num FROM alembic_version").fetchone()[0]  # restorable as is
    con.close()
    with server.client() as c:  # the server never noticed
        assert c.get("/api/jobs").json()["total"] == len(ids)
    bad = subprocess.run([sys.executable, "-m", "tokenpulse.cli", "db", "backup", str(tmp_path / "x.db"),
                          "--data-dir", str(tmp_path / "nowhere")], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 1 and "no database" in bad.stdout, bad.stdout


@pytest.mark.skipif(pg.bin_dir() is None, reason="PostgreSQL is not installed (make setup installs it)")
def test_db_backup_of_postgresql_is_a_pg_dump_that_restores(server_factory, tmp_path):
    url = pg.cluster().create_database("bk")
    srv = server_factory(database_url=url)
    with srv.client() as c:
        for i in range(3):
            c.post("/api/jobs", json={"max_steps": 3, "name": f"pg{i}"}).raise_for_status()
    out = tmp_path / "backups" / "tokenpulse.dump"
    r = subprocess.run([sys.executable, "-m", "tokenpulse.cli", "db", "backup", str(out), "--data-dir",
                        str(srv.data_dir)], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "TOKENPULSE_DATABASE_URL": url})
    assert r.returncode == 0 and "pg_restore" in r.stdout, r.stdout + r.stderr
    restored = pg.cluster().create_database("restored")
    target = restored.replace("postgresql+psycopg://", "postgresql://")
    done = subprocess.run([str(pg.bin_dir() / "pg_restore"), "--no-owner", "-d", target, str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with pg.connect(restored) as con:
        names = [row[0] for row in con.execute("SELECT name FROM jobs ORDER BY id").fetchall()]
    assert names == ["pg0", "pg1", "pg2"]
