#!/usr/bin/env python3
"""Server load bench (issue 7): ingest, fan-out, reads, storage, heartbeats; one table, with the
MLflow and raw-SQLite anchors measured in the same run (../shared/bench/mlflow_ingest_anchor.py,
in its own venv: never a tokenpulse dependency).

    .venv/bin/python bench/server_load.py                       # everything (~6 min on 2 cores)
    .venv/bin/python bench/server_load.py --skip-anchor         # tokenpulse only (~1.5 min)
    .venv/bin/python bench/server_load.py --anchor-json F.json  # reuse an anchor run
    .venv/bin/python bench/server_load.py --postgres --servers 2 # on a throwaway PostgreSQL, browsers
        on a second server process; MLflow's server on the same PostgreSQL as the anchor

What runs, all real processes over real sockets:
  probe   : 300 sequential keep-alive POSTs on one connection (the uvicorn TCP_NODELAY 44 ms stall
            check) against the idle server.
  ingest  : 4 agent processes (worker.agent.Agent: its outbox/journal, batching and HTTP calls),
            each offering --rate metric points/s (events of 8 values, like the training loop's);
            a 5th agent posts one metric every 20 ms stamped with its send time; 100 websocket
            clients (asyncio, one process) subscribed to jobs, alerts, the probe job and one load
            job each, measure send->receive of every probe point; one more websocket client
            subscribed to everything never reads (tiny receive buffer). Server CPU from /proc over
            the timed window; stored vs sent counted exactly after the agents drain.
  hb      : 100 agents (one asyncio process, one connection each): heartbeat every 2 s and a phase
            event every 1 s each (a training step a second); server CPU over the window.
  reads   : one job with 1,000,000 steps of "loss" (with spikes) and 100,000 of "val_loss",
            ingested over the agent protocol; 10,000 jobs (copied rows, SQL); timed REST reads,
            EXPLAIN QUERY PLAN of the read paths, bytes on disk per point.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PY = sys.executable
CLK = os.sysconf("SC_CLK_TCK")
ANCHOR = ROOT.parent / "shared" / "bench" / "mlflow_ingest_anchor.py"
MLFLOW_VENV = Path(os.environ.get("MLFLOW_VENV", "/tmp/mlflow-venv"))
# --rules: ten alert rules over the load's metrics (server/rules.py), every condition that reads a value
RULES = [{"name": f"bench-{i}", **r} for i, r in enumerate([
    {"condition": "above", "metric": "loss", "threshold": 1e9}, {"condition": "below", "metric": "lr", "threshold": -1},
    {"condition": "no_improvement", "metric": "loss", "steps": 10**8},
    {"condition": "jump", "metric": "grad_norm", "sigmas": 1000},
    {"condition": "nonfinite", "metric": "mfu"}, {"condition": "above", "metric": "rss_mb", "threshold": 1e12},
    {"condition": "no_improvement", "metric": "tokens_per_s", "steps": 10**8, "mode": "max"},
    {"condition": "jump", "metric": "step_time_s", "sigmas": 1000},
    {"condition": "below", "metric": "epoch", "threshold": -1},
    {"condition": "state", "state": "failed"}])]
KEYS = ("loss", "lr", "grad_norm", "rss_mb", "epoch", "tokens_per_s", "step_time_s", "mfu")
# The issue's anchors (2 cores, measured earlier): printed only when the anchor cannot run here.
ISSUE_ANCHORS = {"ingest": 15900, "sqlite_ingest": 434000, "calls": 19, "cpu_us": 90, "read100k": 3.46,
                 "down": 0.30, "bytes": 250, "sqlite_bytes": 61, "sqlite_read": 0.14}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def pct(xs, q):
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def cpu_of(pid: int) -> float:
    """utime+stime seconds of a process (the server is one process: uvicorn, no workers)."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / CLK


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BenchDB:
    """The bench's own look at the store (counts, seeding, query plans, sizes): sqlite3 on the
    SQLite file, psycopg on PostgreSQL. Queries are written with `?` for both."""

    def __init__(self, db_path: Path, url: str | None = None, readonly: bool = False):
        self.pg = bool(url)
        if self.pg:
            import psycopg
            self.con = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True)
        elif readonly:
            self.con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
        else:
            self.con = sqlite3.connect(db_path, timeout=30)
        self.db_path = db_path

    def execute(self, q: str, p=()):
        return self.con.execute(q.replace("?", "%s") if self.pg else q, p)

    def scalar(self, q: str, p=()):
        return self.execute(q, p).fetchone()[0]

    def commit(self):
        if not self.pg:
            self.con.commit()

    def plan(self, q: str, p=()) -> list[str]:
        if self.pg:
            return [r[0].strip() for r in self.execute("EXPLAIN " + q, p)]
        return [r[3] for r in self.execute("EXPLAIN QUERY PLAN " + q, p)]

    def sizes(self) -> tuple[int, int | None]:
        """(bytes of the whole database, bytes of the metric tables and their indexes)"""
        if self.pg:
            return (self.scalar("SELECT pg_database_size(current_database())"),
                    self.scalar("SELECT pg_total_relation_size('metrics') + pg_total_relation_size('metric_rollups')"))
        self.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        try:
            sizes = dict(self.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name"))
            metric_bytes = sum(v for k, v in sizes.items() if k in ("metrics", "metric_rollups"))
        except sqlite3.OperationalError:
            metric_bytes = None
        return os.path.getsize(self.db_path), metric_bytes

    def close(self):
        self.con.close()


# ---- child roles ----------------------------------------------------------------------------------

def role_agent(a) -> None:
    """A real agent (worker.agent.Agent: register, claim, journaled outbox, batched flushes,
    heartbeats) whose 'training process' is a generator offering a.rate points/s."""
    from worker.agent import Agent

    async def main():
        agent = Agent(a.url, a.token, Path(a.work), name=a.name, heartbeat_s=2.0, flush_s=0.25)
        agent.outbox.recover()
        await agent.link.register()
        r = await agent.link.call("POST", f"/api/agents/{agent.link.agent_id}/claim")
        claim = r.json()
        job_id = claim["job_id"]
        agent.outbox.open_job(job_id, claim["seq_start"])
        # what the agent knows of a running job (its heartbeat reports alive_at)
        agent.jobs[job_id] = SimpleNamespace(alive_at=time.time(), requested=None, process=None, gang=None,
                                              claim=SimpleNamespace(job_id=job_id, node_rank=0))
        loops = [asyncio.create_task(agent.link.flush_loop()), asyncio.create_task(agent.link.heartbeat_loop())]
        per_event = len(KEYS)
        events_per_s = a.rate / per_event
        await asyncio.sleep(max(0.0, a.start_at - time.time()))
        t0, step = time.time(), 0
        while time.time() < a.start_at + a.duration:
            due = int((time.time() - t0) * events_per_s)  # paced: the offered load is a.rate
            while step < due:
                vals = {k: math.sin(step * 0.01 + i) + i for i, k in enumerate(KEYS)}
                agent.outbox.add(job_id, "metrics", {"step": step, "values": vals})
                step += 1
            await asyncio.sleep(0.01)
        sent_at = time.time()
        while agent.outbox.size():
            agent.flush_now.set()
            await asyncio.sleep(0.02)
        drained = time.time() - sent_at
        for t in loops:
            t.cancel()
        print(json.dumps({"job_id": job_id, "points": step * per_event, "events": step,
                          "drain_s": round(drained, 3)}), flush=True)
    asyncio.run(main())


def role_probe(a) -> None:
    """One metric point every a.every s, stamped with its send time; also the keep-alive probe."""
    import httpx
    c = httpx.Client(base_url=a.url, timeout=30, headers={"Authorization": f"Bearer {a.token}"})
    aid = c.post("/api/agents", json={"name": "probe", "host": "bench"}).json()["id"]
    job = c.post(f"/api/agents/{aid}/claim").json()["job_id"]
    print("claimed", job, flush=True)
    time.sleep(max(0.0, a.start_at - time.time()))
    lat, seq = [], 0
    end = a.start_at + a.duration
    while time.time() < end:
        t = time.time()
        r = c.post(f"/api/agents/{aid}/events", json={"events": [
            {"kind": "metrics", "job_id": job, "seq": seq, "t": t, "data": {"step": seq, "values": {"probe": t}}}]})
        r.raise_for_status()
        lat.append(time.time() - t)
        seq += 1
        time.sleep(max(0.0, t + a.every - time.time()))
    print(json.dumps({"sent": seq, "post_p50_ms": pct(lat, 50) * 1e3, "post_p99_ms": pct(lat, 99) * 1e3}), flush=True)


def role_ws(a) -> None:
    """a.clients websocket clients + one stalled one; latency of the probe job's points."""
    from websockets.asyncio.client import connect
    probe = a.probe_job
    prefix = f'{{"type":"events","job_id":{probe},'
    lat: list[float] = []
    frames = [0]
    nbytes = [0]

    async def client(i: int, topics: str):
        async with connect(f"{a.ws}?topics={topics}", additional_headers={"Authorization": f"Bearer {a.token}"},
                           max_size=None) as ws:
            ready.append(i)
            async for msg in ws:
                now = time.time()
                frames[0] += 1
                nbytes[0] += len(msg)
                if msg.startswith(prefix):
                    for e in json.loads(msg)["events"]:
                        lat.append(now - e["t"])

    async def stalled(topics: str):
        """Connects, subscribes, never reads: the kernel buffers fill, then the server's."""
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((a.host, a.port))
        key = "dGhlIHNhbXBsZSBub25jZQ=="
        s.sendall((f"GET /ws?topics={topics} HTTP/1.1\r\nHost: {a.host}\r\nUpgrade: websocket\r\n"
                   f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                   f"Authorization: Bearer {a.token}\r\n\r\n").encode())
        ready.append(-1)
        return s

    async def main():
        loads = a.load_jobs.split(",")
        tasks = [asyncio.create_task(client(i, f"jobs,alerts,job:{probe},job:{loads[i % len(loads)]}"))
                 for i in range(a.clients)]
        st = await stalled(",".join(["jobs", "alerts", f"job:{probe}"] + [f"job:{j}" for j in loads]))
        while len(ready) < a.clients + 1:
            await asyncio.sleep(0.05)
        print("ready", flush=True)
        await asyncio.sleep(max(0.0, a.end_at - time.time()))
        print(json.dumps({"clients": len(ready) - 1, "latencies": len(lat), "p50_ms": pct(lat, 50) * 1e3,
                          "p99_ms": pct(lat, 99) * 1e3, "max_ms": max(lat, default=float("nan")) * 1e3,
                          "frames": frames[0], "mbytes": round(nbytes[0] / 1e6, 1)}), flush=True)
        st.close()
        for t in tasks:
            t.cancel()
    ready: list[int] = []
    asyncio.run(main())


def role_hb(a) -> None:
    """a.agents agents, one connection each: heartbeat every 2 s, a phase event every 1 s."""
    import httpx

    async def one(i: int, c: httpx.AsyncClient, start_evt: asyncio.Event, counts: list):
        aid = (await c.post("/api/agents", json={"name": f"hb{i}", "host": "bench"})).json()["id"]
        job = (await c.post(f"/api/agents/{aid}/claim")).json()["job_id"]
        counts[2] += 1
        await start_evt.wait()
        await asyncio.sleep(i * 1.0 / a.agents)  # spread, like independent machines
        seq, next_hb = 0, 0.0
        while time.time() < a.end_at:
            now = time.time()
            if now >= next_hb:
                (await c.post(f"/api/agents/{aid}/heartbeat", json={"jobs": {str(job): now}})).raise_for_status()
                next_hb = now + 2.0
                counts[0] += 1
            r = await c.post(f"/api/agents/{aid}/events", json={"events": [
                {"kind": "phase", "job_id": job, "seq": seq, "t": now,
                 "data": {"name": "training", "done": seq, "total": 100000, "unit": "steps"}}]})
            r.raise_for_status()
            seq += 1
            counts[1] += 1
            await asyncio.sleep(max(0.0, now + 1.0 - time.time()))

    async def one_ws(i: int, c: httpx.AsyncClient, start_evt: asyncio.Event, counts: list):
        """The same agent on its websocket (server/api/agent_ws.py): one connection for everything."""
        from websockets.asyncio.client import connect
        aid = (await c.post("/api/agents", json={"name": f"hb{i}", "host": "bench"})).json()["id"]
        job = (await c.post(f"/api/agents/{aid}/claim")).json()["job_id"]
        await c.aclose()  # from here on, the websocket only
        ws_url = a.url.replace("http://", "ws://") + f"/api/agents/{aid}/ws"
        async with connect(ws_url, additional_headers={"Authorization": f"Bearer {a.token}"},
                           ping_interval=None, open_timeout=120) as ws:
            counts[2] += 1
            await start_evt.wait()
            await asyncio.sleep(i * 1.0 / a.agents)
            seq, next_hb, mid = 0, 0.0, 0
            while time.time() < a.end_at:
                now = time.time()
                mid += 1
                msg = {"id": mid, "events": [
                    {"kind": "phase", "job_id": job, "seq": seq, "t": now,
                     "data": {"name": "training", "done": seq, "total": 100000, "unit": "steps"}}]}
                if now >= next_hb:  # the heartbeat folded into the batch, as the agent does
                    msg["heartbeat"] = {str(job): now}
                    next_hb = now + 2.0
                    counts[0] += 1
                await ws.send(json.dumps(msg))
                reply = json.loads(await ws.recv())
                assert reply.get("acked") == {str(job): seq}, reply
                seq += 1
                counts[1] += 1
                await asyncio.sleep(max(0.0, now + 1.0 - time.time()))

    async def main():
        start_evt, counts = asyncio.Event(), [0, 0, 0]  # heartbeats, phase batches, agents ready
        limits = httpx.Limits(max_connections=4)
        clients = [httpx.AsyncClient(base_url=a.url, timeout=60, headers={"Authorization": f"Bearer {a.token}"},
                                     limits=limits) for _ in range(a.agents)]
        body = one_ws if a.channel == "ws" else one
        tasks = [asyncio.create_task(body(i, c, start_evt, counts)) for i, c in enumerate(clients)]
        # All registered, claimed (and connected) first: the orchestrator's window sees only the
        # steady beat, never the registrations of a loaded machine.
        while counts[2] < a.agents:
            await asyncio.sleep(0.1)
        a.end_at = time.time() + a.run_s
        print("ready", flush=True)
        start_evt.set()
        await asyncio.gather(*tasks)
        print(json.dumps({"heartbeats": counts[0], "phase_batches": counts[1]}), flush=True)
    asyncio.run(main())


# ---- the orchestrator -----------------------------------------------------------------------------

class Bench:
    def __init__(self, a):
        self.a = a
        self.dir = Path(tempfile.mkdtemp(prefix="tp-server-load-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.res: dict = {}

    def start_server(self):
        data = self.dir / "data"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENPULSE_RULES_PER_USER": "1000"}
        self.store = "sqlite"
        if self.a.database_url:
            env["TOKENPULSE_DATABASE_URL"] = self.a.database_url
            self.store = "postgresql"
        self.server_log = (self.dir / "server.log").open("w")
        self.server = self.spawn_server(data, self.port, env, self.server_log)
        # browsers on a second server process (PostgreSQL): every frame they get crosses processes
        self.ws_port, self.servers = self.port, [self.server]
        if self.a.servers > 1:
            if not self.a.database_url:
                raise SystemExit("--servers 2 needs --database-url (several server processes share PostgreSQL)")
            self.ws_port = free_port()
            self.servers.append(self.spawn_server(data, self.ws_port, env, (self.dir / "server2.log").open("w")))
        self.db_path = data / "tokenpulse.db"
        self.user = (data / "token").read_text().strip()
        self.agent_token = (data / "agent_token").read_text().strip()
        import httpx
        self.http = httpx.Client(base_url=self.url, timeout=120, headers={"Authorization": f"Bearer {self.user}"})

    def spawn_server(self, data: Path, port: int, env: dict, out) -> subprocess.Popen:
        import httpx
        proc = subprocess.Popen([PY, "-m", "tokenpulse.cli", "server", "--data-dir", str(data), "--port", str(port)],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        return proc

    def servers_cpu(self) -> float:
        return sum(cpu_of(p.pid) for p in self.servers)

    def db(self, readonly: bool = False) -> BenchDB:
        return BenchDB(self.db_path, self.a.database_url, readonly)

    def submit(self, name: str, priority: int = 0) -> int:
        return self.http.post("/api/jobs", json={"name": name, "priority": priority}).json()["id"]

    def child(self, role: str, *args: str) -> subprocess.Popen:
        return subprocess.Popen([PY, __file__, role, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True)

    def stop_server(self):
        for p in self.servers:
            p.send_signal(signal.SIGTERM)
        for p in self.servers:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()

    # -- phases --
    def rule_cost(self):
        """Ingest with 1,000 alert rules defined vs none (issue 34: rules are judged beside ingest,
        after the writer's commit, and a person's rules watch that person's jobs): one agent posts
        2,000-point batches back to back for --rules-s seconds, alternating: no rule; 1,000 rules of
        other users (10 users x 100, on the batch's own metrics); none again (those removed); the job
        owner's own 100 (rules_per_user), each judged on every batch. Points/s side by side."""
        import httpx
        a = self.a
        agent = httpx.Client(base_url=self.url, timeout=120, headers={"Authorization": f"Bearer {self.agent_token}"})
        aid = agent.post("/api/agents", json={"name": "rules-load", "host": "bench"}).json()["id"]
        owner = self.http.post("/api/tokens", json={"name": "rules-owner", "role": "user"}).json()["token"]
        with httpx.Client(base_url=self.url, timeout=60, headers={"Authorization": f"Bearer {owner}"}) as c:
            job = c.post("/api/jobs", json={"name": "rules-load"}).json()["id"]
        assert agent.post(f"/api/agents/{aid}/claim").json()["job_id"] == job
        seq = [0]

        def load() -> float:
            points, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < a.rules_s:
                ev = [{"kind": "metrics", "job_id": job, "seq": seq[0] + i, "t": time.time(),
                       "data": {"step": seq[0] + i, "values": {"loss": 2.0 + (i % 13) * 0.01, "lr": 1e-4, "gnorm": 1.0,
                                                                "acc": 0.5, "a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}}}
                      for i in range(250)]
                agent.post(f"/api/agents/{aid}/events", json={"events": ev}).raise_for_status()
                seq[0] += 250
                points += 2000
            return points / (time.perf_counter() - t0)

        def rules_of(token: str, n: int) -> list[int]:
            with httpx.Client(base_url=self.url, timeout=60, headers={"Authorization": f"Bearer {token}"}) as c:
                return [c.post("/api/rules", json={**RULES[i % 9], "name": f"r{i}"}).raise_for_status().json()["id"]
                        for i in range(n)]  # every metric condition (RULES[9], a state rule, left out)
        res = {"none": load()}
        made = [rules_of(self.http.post("/api/tokens", json={"name": f"rules-{u}", "role": "user"}).json()["token"],
                         100) for u in range(10)]
        res["1000_others"] = load()
        for ids in made:
            for rid in ids:
                self.http.delete(f"/api/rules/{rid}").raise_for_status()
        res["none_again"] = load()
        rules_of(owner, 100)
        res["100_owners"] = load()
        agent.close()
        self.res["rules"] = res
        log("ingest with rules (points/s)", res)

    def probe_keepalive(self):
        """Sequential keep-alive calls on one connection: a 44 ms Nagle/delayed-ACK stall shows as
        p50 ~ 44 ms (and ~20 calls/s); without it a call is ~1 ms."""
        import httpx
        c = httpx.Client(base_url=self.url, timeout=30, headers={"Authorization": f"Bearer {self.agent_token}"})
        aid = c.post("/api/agents", json={"name": "nodelay-probe", "host": "bench"}).json()["id"]
        lat = []
        t0 = time.perf_counter()
        for _ in range(300):
            a = time.perf_counter()
            c.post(f"/api/agents/{aid}/heartbeat", json={"jobs": {}}).raise_for_status()
            lat.append(time.perf_counter() - a)
        el = time.perf_counter() - t0
        self.res["keepalive"] = {"calls_per_s": round(300 / el), "p50_ms": pct(lat, 50) * 1e3,
                                 "p99_ms": pct(lat, 99) * 1e3}
        log("keep-alive probe", self.res["keepalive"])

    def ingest(self):
        a = self.a
        start_at = time.time() + 10  # agents import and register meanwhile
        end_at = start_at + a.duration
        ws_end = end_at + 1.0
        for body in RULES[:a.rules]:  # alert rules on the load's own metrics, evaluated on every batch
            self.http.post("/api/rules", json=body).raise_for_status()
        probe = self.submit("probe", priority=100)
        pr = self.child("_probe", "--url", self.url, "--token", self.agent_token, "--start-at", str(start_at),
                        "--duration", str(a.duration), "--every", "0.02")
        assert pr.stdout.readline().split() == ["claimed", str(probe)]
        loads = [self.submit(f"load{i}") for i in range(4)]
        ws = self.child("_ws", "--ws", f"ws://127.0.0.1:{self.ws_port}/ws", "--host", "127.0.0.1", "--port",
                        str(self.ws_port), "--token", self.user, "--clients", str(a.clients), "--probe-job",
                        str(probe), "--load-jobs", ",".join(map(str, loads)), "--end-at", str(ws_end))
        assert ws.stdout.readline().strip() == "ready", "websocket clients did not connect"
        agents = [self.child("_agent", "--url", self.url, "--token", self.agent_token, "--work",
                             str(self.dir / f"agent{i}"), "--name", f"load{i}", "--rate", str(a.rate),
                             "--start-at", str(start_at), "--duration", str(a.duration)) for i in range(4)]
        # Timed window: after a 2 s ramp, to the end of the offered load.
        w0 = start_at + 2.0
        time.sleep(max(0.0, w0 - time.time()))
        db = self.db(readonly=True)
        kids = {"ws": ws, "probe": pr, **{f"agent{i}": p for i, p in enumerate(agents)}}
        k0 = {k: cpu_of(p.pid) for k, p in kids.items()}
        n0, c0, t0 = db.scalar("SELECT COUNT(*) FROM metrics"), self.servers_cpu(), time.time()
        time.sleep(max(0.0, end_at - time.time()))
        n1, c1, t1 = db.scalar("SELECT COUNT(*) FROM metrics"), self.servers_cpu(), time.time()
        self.res["ingest_client_cores"] = {k: round((cpu_of(p.pid) - k0[k]) / (t1 - t0), 2) for k, p in kids.items()}
        with open("/proc/loadavg") as f:
            self.res["loadavg"] = f.read().split()[:3]
        outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in agents]
        probe_out = json.loads(pr.communicate()[0].strip().splitlines()[-1])
        ws_out = json.loads(ws.communicate()[0].strip().splitlines()[-1])
        sent = sum(o["points"] for o in outs)
        stored = sum(db.scalar("SELECT COUNT(*) FROM metrics WHERE job_id = ?", (o["job_id"],)) for o in outs)
        db.close()
        self.res["ingest"] = {"offered_pts_s": 4 * a.rate, "pts_s": round((n1 - n0) / (t1 - t0)),
                              "cpu_us_per_pt": (c1 - c0) / max(1, n1 - n0) * 1e6,
                              "server_cores": (c1 - c0) / (t1 - t0), "servers": len(self.servers), "sent": sent,
                              "stored": stored,
                              "drain_s": max(o["drain_s"] for o in outs), "probe": probe_out, "ws": ws_out}
        log("ingest", json.dumps(self.res["ingest"]))

    def heartbeats(self):
        n, channel = self.a.hb_agents, self.a.hb_channel
        jobs = [self.submit(f"hb{i}") for i in range(n)]
        p = self.child("_hb", "--url", self.url, "--token", self.agent_token, "--agents", str(n),
                       "--channel", channel, "--run-s", str(2 + self.a.hb_duration))
        while p.stdout.readline().strip() != "ready":  # every agent registered, claimed, connected
            pass
        end_at = time.time() + 2 + self.a.hb_duration
        log(f"hb: {n} agents ({channel}) registered and running")
        time.sleep(2)  # all spread out and running
        c0, t0 = self.servers_cpu(), time.time()
        time.sleep(max(0.0, end_at - time.time()))
        c1, t1 = self.servers_cpu(), time.time()
        out = json.loads(p.communicate()[0].strip().splitlines()[-1])
        in_window = (out["heartbeats"] + out["phase_batches"]) * self.a.hb_duration / (self.a.hb_duration + 2)
        self.res["hb"] = {**out, "core_pct": (c1 - c0) / (t1 - t0) * 100, "jobs": len(jobs),
                          "cpu_ms_per_request": (c1 - c0) / in_window * 1e3, "agents": n, "channel": channel,
                          # at the nominal rate (1.5 messages per agent a second), whatever the
                          # loaded bench client managed to send
                          "nominal_core_pct": (c1 - c0) / in_window * 1.5 * n * 100, "store": self.store}
        log("heartbeats", self.res["hb"])

    def reads(self):
        import httpx
        import orjson
        job = self.submit("history", priority=100)
        ag = httpx.Client(base_url=self.url, timeout=120, headers={"Authorization": f"Bearer {self.agent_token}"})
        # capacity 64: earlier phases' jobs, requeued once their agents are declared lost, may be
        # claimed first; the seeder just holds them
        aid = ag.post("/api/agents", json={"name": "seeder", "host": "bench", "capacity": 64}).json()["id"]
        for _ in range(64):
            r = ag.post(f"/api/agents/{aid}/claim")
            assert r.status_code == 200, (r.status_code, r.text)
            if r.json()["job_id"] == job:
                break
        n, spikes = 1_000_000, {123_457: 100.0, 777_777: -100.0}
        t0 = time.time()
        for b in range(0, n, 10_000):
            evs = []
            for s in range(b, b + 10_000):
                v = {"loss": spikes.get(s, 2.0 / (1 + s * 1e-4) + 0.01 * math.sin(s))}
                if s % 10 == 0:
                    v["val_loss"] = 1.0 / (1 + s)
                evs.append({"kind": "metrics", "job_id": job, "seq": s, "t": 1.7e9 + s,
                            "data": {"step": s, "values": v}})
            r = ag.post(f"/api/agents/{aid}/events", json={"events": evs})
            r.raise_for_status()
            assert not r.json()["commands"], r.text  # still our job (a lost lease would cancel it)
            ag.post(f"/api/agents/{aid}/heartbeat", json={"jobs": {str(job): time.time()}}).raise_for_status()
        log(f"seeded 1.1M points over the agent protocol in {time.time() - t0:.1f} s")
        # 10,000 jobs: copies of one finished row (SQL; submitting them one by one is not the point here)
        db = self.db()
        need = max(0, 10_000 - db.scalar("SELECT COUNT(*) FROM jobs"))
        numbers = ("generate_series(1, ?) AS n(i)" if db.pg else
                   "(WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?) SELECT i FROM n) AS n")
        db.execute(f"""INSERT INTO jobs (name, state, spec, priority, created_at, attempt, next_seq, total_steps, step,
                                         last)
            SELECT 'bulk-' || i, 'completed', spec, 0, created_at, 1, 0, 200, 200, '{{"loss": 1.5}}' FROM {numbers},
            (SELECT spec, created_at FROM jobs ORDER BY id LIMIT 1) AS first""", (need,))
        db.commit()
        njobs = db.scalar("SELECT COUNT(*) FROM jobs")

        def timed(path, params, reads, check=None):
            lat = []
            for i in range(reads + 1):
                a = time.perf_counter()
                r = self.http.get(path, params=params)
                r.raise_for_status()
                body = orjson.loads(r.content)  # timed too: request, transfer and parse
                if i:
                    lat.append(time.perf_counter() - a)
                if check:
                    check(body)
            return {"p50_ms": pct(lat, 50) * 1e3, "p90_ms": pct(lat, 90) * 1e3, "bytes": len(r.content)}

        def full(b):
            assert len(b["series"]["val_loss"]["step"]) == 100_000

        def down(b):
            s = b["series"]["loss"]
            assert s["total_points"] == n and len(s["step"]) <= 1000, (s["total_points"], len(s["step"]))
            assert max(s["value"]) == 100.0 and min(s["value"]) == -100.0, "a spike was lost"
            assert s["step"][0] == 0 and s["step"][-1] == n - 1
        self.res["read_full"] = timed(f"/api/jobs/{job}/metrics", {"keys": "val_loss", "max_points": 1_000_000}, 10,
                                      full)
        self.res["read_down"] = timed(f"/api/jobs/{job}/metrics", {"keys": "loss", "max_points": 1000}, 20, down)
        self.res["read_down_lttb"] = timed(f"/api/jobs/{job}/metrics", {"keys": "loss", "max_points": 1000,
                                                                        "mode": "lttb"}, 5)
        self.res["jobs_list"] = timed("/api/jobs", {"limit": 50}, 20, lambda b: b["total"] == njobs)
        self.res["jobs_list"]["jobs"] = njobs
        log("reads", {k: self.res[k] for k in ("read_full", "read_down", "read_down_lttb", "jobs_list")})
        plans = {
            "full history": ("SELECT step, t, value FROM metrics WHERE job_id = ? AND key_id = ? AND attempt = ? "
                             "ORDER BY step", (job, 1, 1)),
            "range ends": ("SELECT MIN(step) FROM metrics WHERE job_id = ? AND key_id = ? AND attempt = ? AND step > ?",
                           (job, 1, 1, 5)),
            "rollups": ("SELECT * FROM metric_rollups WHERE job_id = ? AND key_id = ? AND attempt = ? AND bucket "
                        "BETWEEN ? AND ? ORDER BY bucket", (job, 1, 1, 0, 9)),
            "jobs list": ("SELECT * FROM jobs ORDER BY id DESC LIMIT 50", ()),
            "jobs by state": ("SELECT * FROM jobs WHERE state IN ('running') ORDER BY id DESC LIMIT 50", ()),
            "agent's jobs": ("SELECT id FROM jobs WHERE agent_id = ? AND requested_action IS NOT NULL", (1,)),
            "replay watermark": ("SELECT next_seq FROM jobs WHERE id = ?", (1,)),
        }
        self.res["explain"] = {k: db.plan(q, p) for k, (q, p) in plans.items()}
        points = db.scalar("SELECT COUNT(*) FROM metrics")
        file_bytes, metric_bytes = db.sizes()
        self.res["disk"] = {"points": points, "file_bytes": file_bytes, "file_b_per_pt": file_bytes / points,
                            "metric_tables_b_per_pt": metric_bytes / points if metric_bytes else None}
        log("disk", self.res["disk"])
        db.close()

    def anchor(self):
        if self.a.anchor_json:
            self.res["anchor"] = json.loads(Path(self.a.anchor_json).read_text())
            self.res["anchor_src"] = f"from {self.a.anchor_json}"
            return
        mlpy = MLFLOW_VENV / "bin" / "python"
        if self.a.skip_anchor or not mlpy.exists() or not ANCHOR.exists():
            self.res["anchor"] = None
            self.res["anchor_src"] = "issue's numbers (not measured in this run)"
            return
        if self.a.database_url:
            return self.anchor_on_postgres(mlpy)
        work = self.dir / "anchor"
        work.mkdir()
        out = self.dir / "anchor.json"
        log(f"MLflow anchor: {ANCHOR} in {MLFLOW_VENV} (~4 min)")
        r = subprocess.run([str(mlpy), str(ANCHOR), "all", "--workdir", str(work), "--duration",
                            str(self.a.anchor_duration), "--reads", "5", "--out", str(out)],
                           stdout=subprocess.DEVNULL, stderr=(self.dir / "anchor.log").open("w"))
        if r.returncode == 0:
            self.res["anchor"] = json.loads(out.read_text())
            self.res["anchor_src"] = f"measured in this run (--duration {self.a.anchor_duration})"
        else:
            self.res["anchor"] = None
            self.res["anchor_src"] = (f"anchor failed (rc {r.returncode}, see {self.dir / 'anchor.log'}): "
                                      "issue's numbers")

    def anchor_on_postgres(self, mlpy: Path):
        """MLflow's tracking server on the same PostgreSQL (its own database there), and the anchor
        script's `mlflow` phase against it: the same clients and workload as the SQLite anchor."""
        import psycopg
        from sqlalchemy.engine import make_url
        url = make_url(self.a.database_url)
        dbname = f"mlflow_bench_{int(time.time())}"
        admin = url.set(drivername="postgresql").render_as_string(hide_password=False)
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{dbname}"')
        ml_url = url.set(drivername="postgresql", database=dbname).render_as_string(hide_password=False)
        port, work = free_port(), self.dir / "anchor"
        work.mkdir(exist_ok=True)
        env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true")
        cmd = [str(MLFLOW_VENV / "bin" / "mlflow"), "server", "--backend-store-uri", ml_url, "--host", "127.0.0.1",
               "--port", str(port), "--no-serve-artifacts", "--default-artifact-root", str(work / "mlartifacts")]
        log("MLflow anchor on PostgreSQL:", " ".join(cmd))
        proc = subprocess.Popen(cmd, stdout=(self.dir / "mlflow_server.log").open("w"), stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        import httpx
        out = self.dir / "anchor.json"
        try:
            deadline = time.time() + 180
            while time.time() < deadline and proc.poll() is None:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            time.sleep(15)  # its workers finish importing: not billed to the first phase
            r = subprocess.run([str(mlpy), str(ANCHOR), "mlflow", "--uri", f"http://127.0.0.1:{port}", "--server-pid",
                                str(proc.pid), "--duration", str(self.a.anchor_duration), "--reads", "5",
                                "--out", str(out)], stdout=subprocess.DEVNULL,
                               stderr=(self.dir / "anchor.log").open("w"))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        if r.returncode != 0:
            self.res["anchor"] = None
            self.res["anchor_src"] = f"MLflow on PostgreSQL failed (rc {r.returncode}, see {self.dir / 'anchor.log'})"
            return
        ml = json.loads(out.read_text())
        with psycopg.connect(ml_url, autocommit=True) as c:
            n = c.execute("SELECT COUNT(*) FROM metrics").fetchone()[0]
            size = c.execute("SELECT pg_database_size(current_database())").fetchone()[0]
        ml["db"] = {"metric_rows": n, "bytes_per_point": round(size / max(n, 1), 1)}
        self.res["anchor"] = {"mlflow": ml}
        self.res["anchor_src"] = (f"MLflow's server on the same PostgreSQL, measured in this run "
                                  f"(--duration {self.a.anchor_duration})")

    # -- the table --
    def table(self) -> str:
        r, an = self.res, self.res.get("anchor")
        ml = (an or {}).get("mlflow", {})
        sq = (an or {}).get("sqlite", {})
        w1 = (an or {}).get("mlflow_workers1", {})
        anchor = ISSUE_ANCHORS
        mark = "" if an else " (issue)"

        def m(path, fmt, fallback):
            try:
                v = path()
                return fmt(v)
            except (KeyError, TypeError, ZeroDivisionError):
                return f"{fallback}{' (issue)' if fallback != '-' else ''}"
        ing, ws, hb = r.get("ingest", {}), r.get("ingest", {}).get("ws", {}), r.get("hb", {})
        # sustained: everything the agents offered, stored by the time their backlog drained
        dur = r.get("duration", self.a.duration)
        sustained = ing.get("sent", 0) / (dur + ing.get("drain_s", 0)) if ing else 0
        b4 = lambda: ml["b_batch1000_4clients"]  # noqa: E731
        rows = [
            ("ingest, 4 agent processes, real protocol (points/s)", ">= 50,000",
             f"{sustained:,.0f} all stored (offered {ing.get('offered_pts_s', 0):,} for {dur:.0f} s, backlog "
             f"drained {ing.get('drain_s', 0):.2f} s after); {ing.get('pts_s', 0):,} stored/s in the timed window",
             m(lambda: b4()["pts_per_s"], lambda v: f"{v:,} (batches of 1000, 4 clients)", f"{anchor['ingest']:,}"),
             m(lambda: sq["lean_executemany_1000_per_txn"]["pts_per_s"], lambda v: f"{v:,}",
               f"{anchor['sqlite_ingest']:,}"),
             sustained >= 50_000),
            ("stored = sent after drain (nothing lost)", "equal",
             f"{ing.get('stored', 0):,} / {ing.get('sent', 0):,} (drained in {ing.get('drain_s', 0):.2f} s)",
             "-", "-", ing.get("stored") == ing.get("sent") and ing.get("sent", 0) > 0),
            ("server CPU per point", "<= 10 us",
             f"{ing.get('cpu_us_per_pt', 0):.1f} us ({ing.get('server_cores', 0):.2f} cores, fan-out included)",
             m(lambda: b4()["server_cpu_s"] / b4()["points"] * 1e6, lambda v: f"{v:.0f} us", f"~{anchor['cpu_us']} us"),
             "~2.3 us (issue)", ing.get("cpu_us_per_pt", 99) <= 10),
            (f"metric -> {ws.get('clients', 0)} websockets during ingest, p99", "<= 50 ms",
             f"p99 {ws.get('p99_ms', float('nan')):.1f} ms, p50 {ws.get('p50_ms', float('nan')):.1f} ms, "
             f"max {ws.get('max_ms', float('nan')):.0f} ms ({ws.get('latencies', 0):,} deliveries, "
             f"{ws.get('mbytes', 0)} MB; +1 stalled client)", "-", "-", ws.get("p99_ms", 1e9) <= 50),
            ("probe agent POST during ingest, p99", "-",
             f"{ing.get('probe', {}).get('post_p99_ms', float('nan')):.1f} ms",
             "-", "-", None),
            ("keep-alive calls, 1 client (TCP_NODELAY probe)", "no 44 ms stall",
             f"{r['keepalive']['calls_per_s']:,} calls/s, p50 {r['keepalive']['p50_ms']:.2f} ms",
             m(lambda: ml["c_log_metric_1client"],
               lambda v: f"{v['pts_per_s']} calls/s, p50 {v['call_lat']['p50_ms']:.0f} ms"
               + m(lambda: w1["c_log_metric_1client"], lambda w: f" (--workers 1: {w['pts_per_s']}/s)", ""),
               f"{anchor['calls']}/s"),
             m(lambda: sq["lean_1_row_per_txn"]["pts_per_s"], lambda v: f"{v:,} rows/s (1 a txn)", "53,000"),
             r["keepalive"]["p50_ms"] < 20),
            ("read one metric's full history, 100k points", "<= 150 ms", f"{r['read_full']['p50_ms']:.0f} ms "
             f"(p90 {r['read_full']['p90_ms']:.0f}, JSON parsed)",
             m(lambda: ml["d_read_rest_get_history"]["p50_ms"], lambda v: f"{v / 1e3:.2f} s",
               f"{anchor['read100k']} s"),
             m(lambda: sq["lean_read_100k_plus_json_columnar"]["p50_ms"], lambda v: f"{v:.0f} ms (with JSON)",
               "140 ms"),
             r["read_full"]["p50_ms"] <= 150),
            ("downsampled chart, 1,000 of 1,000,000 points (minmax)", "<= 30 ms",
             f"{r['read_down']['p50_ms']:.1f} ms (p90 {r['read_down']['p90_ms']:.1f}; spikes kept)",
             m(lambda: ml["d_read_bulk_interval_1000"]["p50_ms"], lambda v: f"{v / 1e3:.2f} s (1,000 of 100k)",
               f"{anchor['down']} s (1,000 of 100k)"),
             "-", r["read_down"]["p50_ms"] <= 30),
            ("  same, lttb over the rollups", "-", f"{r['read_down_lttb']['p50_ms']:.1f} ms", "-", "-", None),
            (f"jobs list, first page of {r['jobs_list']['jobs']:,} jobs", "<= 30 ms",
             f"{r['jobs_list']['p50_ms']:.1f} ms (p90 {r['jobs_list']['p90_ms']:.1f})", "-", "-",
             r["jobs_list"]["p50_ms"] <= 30),
            ("disk per metric point", "<= 80 B",
             f"{r['disk']['file_b_per_pt']:.0f} B whole file ({r['disk']['points']:,} pts)"
             + (f", {r['disk']['metric_tables_b_per_pt']:.0f} B metric tables"
                if r['disk']['metric_tables_b_per_pt'] else ""),
             m(lambda: ml["db"]["bytes_per_point"], lambda v: f"{v:.0f} B", f"{anchor['bytes']} B"),
             m(lambda: sq["lean_db_bytes_per_point"], lambda v: f"{v:.0f} B", f"{anchor['sqlite_bytes']} B"),
             r["disk"]["file_b_per_pt"] <= 80),
            ("heartbeats (1/2 s) + phase events (1/s) from 100 agents", "< 5% of a core",
             f"{hb.get('core_pct', 0):.1f}% ({hb.get('heartbeats', 0)} hb + {hb.get('phase_batches', 0)} phase "
             "batches; "
             f"~{hb.get('cpu_ms_per_request', 0):.1f} ms CPU a request)",
             "-", "-", hb.get("core_pct", 100) < 5),
        ]
        if "rules" in r:
            ru = r["rules"]
            none = (ru["none"] + ru["none_again"]) / 2
            rows.append(("ingest with 1,000 rules of other users | 100 of the job's owner, vs none (points/s)",
                         ">= 0.90 x none", f"{ru['1000_others']:,.0f} ({ru['1000_others'] / none:.2f}x) | "
                         f"{ru['100_owners']:,.0f} ({ru['100_owners'] / none:.2f}x) vs {none:,.0f} (two runs)",
                         "-", "-", ru["1000_others"] / none >= 0.9))
        store = r.get("store", "sqlite")
        head = (f"store: {store}, {r.get('servers', 1)} server process(es)\n\n"
                "| | goal | tokenpulse | MLflow" + mark + " | raw SQLite" + mark + " | |\n|---|---|---|---|---|---|")
        lines = [head] + [f"| {a} | {b} | {c} | {d} | {e} | {'ok' if f else ('-' if f is None else 'MISSED')} |"
                          for a, b, c, d, e, f in rows]
        ver = (an or {}).get("mlflow", {}).get("mlflow_version")
        lines.append(f"\nMLflow/raw SQLite: {self.res.get('anchor_src')}" + (f", MLflow {ver}" if ver else ""))
        lines.append(f"Load average (2 cores, shared) during the ingest phase: {' '.join(r.get('loadavg', []))}; "
                     f"client processes' cores then: {r.get('ingest_client_cores')}")
        lines.append("\nEXPLAIN QUERY PLAN:")
        for k, v in r["explain"].items():
            lines.append(f"  {k}: {'; '.join(v)}")
        return "\n".join(lines)

    def run(self):
        a = self.a
        self.res["duration"] = a.duration
        if a.render:  # re-print the table of an earlier run
            self.res = json.loads(Path(a.render).read_text())
            print(self.table())
            return
        try:
            self.start_server()
            self.res["store"], self.res["servers"] = self.store, len(self.servers)
            for ph in a.phases.split(","):
                {"probe": self.probe_keepalive, "ingest": self.ingest, "hb": self.heartbeats,
                 "reads": self.reads, "rules": self.rule_cost}[ph]()
        finally:
            self.stop_server()
        if a.no_table:
            print(json.dumps(self.res, default=str))
            return
        self.anchor()  # after, on a quiet machine: never beside tokenpulse's phases
        text = self.table()
        print(text)
        out = ROOT / "bench" / "results"
        out.mkdir(exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        (out / f"server_load-{stamp}.json").write_text(json.dumps(self.res, indent=1, default=str))
        (out / f"server_load-{stamp}.md").write_text(text + "\n")
        log(f"results in {out}/server_load-{stamp}.*; scratch in {self.dir}")


def main():
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # 1,000 agents: a socket each, both sides
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="role")
    b = sub.add_parser("run")
    for p in (ap, b):
        p.add_argument("--rate", type=int, default=15_000, help="points/s offered by each of the 4 agents")
        p.add_argument("--duration", type=float, default=10.0, help="seconds of offered ingest load")
        p.add_argument("--clients", type=int, default=100)
        p.add_argument("--hb-duration", type=float, default=8.0)
        p.add_argument("--hb-agents", type=int, default=100)
        p.add_argument("--hb-channel", choices=("http", "ws"), default="ws",
                       help="agents on HTTP requests or on their websocket (server/api/agent_ws.py)")
        p.add_argument("--database-url", help="a PostgreSQL URL (an empty database) instead of SQLite")
        p.add_argument("--postgres", action="store_true",
                       help="start a throwaway PostgreSQL cluster (Debian's postgresql, tests/pg.py) and use it")
        p.add_argument("--servers", type=int, default=1, choices=(1, 2),
                       help="2: a second server process on the same PostgreSQL serves the websocket clients")
        p.add_argument("--skip-anchor", action="store_true")
        p.add_argument("--rules", type=int, default=0, choices=range(0, 11),
                       help="alert rules defined (0-10, on every job and the load's metrics) during ingest")
        p.add_argument("--phases", default="probe,ingest,hb,reads,rules")
        p.add_argument("--rules-s", type=float, default=5.0, help="seconds of each side of the rules phase")
        p.add_argument("--no-table", action="store_true")
        p.add_argument("--render", help="print the table of an earlier run's results JSON")
        p.add_argument("--anchor-json")
        p.add_argument("--anchor-duration", type=float, default=5.0)
    c = sub.add_parser("_agent")
    for k in ("--url", "--token", "--work", "--name"):
        c.add_argument(k)
    c.add_argument("--rate", type=float)
    c.add_argument("--start-at", type=float)
    c.add_argument("--duration", type=float)
    c = sub.add_parser("_probe")
    for k in ("--url", "--token"):
        c.add_argument(k)
    for k in ("--start-at", "--duration", "--every"):
        c.add_argument(k, type=float)
    c = sub.add_parser("_ws")
    for k in ("--ws", "--host", "--token", "--load-jobs"):
        c.add_argument(k)
    for k in ("--port", "--clients", "--probe-job"):
        c.add_argument(k, type=int)
    c.add_argument("--end-at", type=float)
    c = sub.add_parser("_hb")
    for k in ("--url", "--token"):
        c.add_argument(k)
    c.add_argument("--agents", type=int)
    c.add_argument("--channel", default="http")
    c.add_argument("--run-s", type=float)
    a = ap.parse_args()
    roles = {"_agent": role_agent, "_probe": role_probe, "_ws": role_ws, "_hb": role_hb}
    if a.role in roles:
        roles[a.role](a)
    else:
        if getattr(a, "postgres", False) and not a.database_url:
            from tests import pg
            a.database_url = pg.cluster().create_database("bench")  # stopped and removed at exit
        Bench(a).run()


if __name__ == "__main__":
    main()
