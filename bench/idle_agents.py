#!/usr/bin/env python3
"""Idle agents: what N agents with no job cost the server, per way of speaking the agent protocol.

A real server (`tokenpulse.cli server`, a fresh data dir per row) and N lightweight agents in one
asyncio process speaking the real protocol: registered over HTTP, heartbeating every 2 s, claiming.
The agents' own code is not measured: the number is the server process's CPU time (user + system,
all its threads, from /proc) over the window, as a share of one core. CPU time, not wall time, so a
busy machine (a test suite beside it) slows the run but hardly moves the figure.

Rows:
  http         heartbeats over HTTP, a claim every second        (an agent without the websocket)
  socket       heartbeats over the websocket, a claim every second (the agent before the work push)
  socket+push  heartbeats over the websocket; claims when the server says a job waits
               (worker/agent/channel.py wait_for_work: a "work" push on submit, "work" in
               heartbeat answers while any job waits; IDLE_CLAIM_S at most without either)

After each window one job is submitted: "first claim" is how long until an agent held it.

    .venv/bin/python bench/idle_agents.py                 # 100 agents, 60 s per row
    .venv/bin/python bench/idle_agents.py --agents 20 --window 10 --rows socket+push
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from tokenpulse.protocol import Heartbeat  # noqa: E402
from worker.agent.channel import Channel  # noqa: E402

ROWS = ("http", "socket", "socket+push")
HEARTBEAT_S, POLL_S = 2.0, 1.0  # the agent's defaults (worker/agent/agent.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process, every thread of it (/proc/<pid>/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


class IdleAgent:
    """An agent with nothing to run: heartbeats and claims, as worker/agent/agent.py does when idle."""

    def __init__(self, url: str, token: str, name: str, mode: str):
        self.url, self.token, self.name, self.mode = url, token, name, mode
        self.http = httpx.AsyncClient(base_url=url, timeout=60, headers={"Authorization": f"Bearer {token}"})
        self.agent_id: int | None = None
        self.channel: Channel | None = None
        self.stopped = asyncio.Event()
        self.claimed_at: float | None = None  # wall time its claim got a job
        self.claims = 0

    async def run(self) -> None:
        r = await self.http.post("/api/agents", json={"name": self.name, "host": "bench"})
        self.agent_id = r.json()["id"]
        tasks = [asyncio.create_task(self.heartbeat_loop()), asyncio.create_task(self.claim_loop())]
        if self.mode != "http":
            self.channel = Channel(self.url, self.token, lambda: self.agent_id, lambda: None)
            tasks.append(asyncio.create_task(self.channel.run()))
        try:
            await self.stopped.wait()
        finally:
            for t in tasks:
                t.cancel()
            await self.http.aclose()

    async def heartbeat_loop(self) -> None:
        while True:
            reply = await self.channel.heartbeat(Heartbeat()) if self.channel is not None else None
            if reply is None or "status" in reply:
                await self.http.post(f"/api/agents/{self.agent_id}/heartbeat", json={"jobs": {}, "ranks": {}})
            await asyncio.sleep(HEARTBEAT_S)

    async def claim_loop(self) -> None:
        while self.claimed_at is None:
            sent = time.monotonic()
            r = await self.http.post(f"/api/agents/{self.agent_id}/claim", json={})
            self.claims += 1
            if r.status_code == 200:
                self.claimed_at = time.time()
                return
            if self.mode == "socket+push" and self.channel is not None:
                await self.channel.wait_for_work(sent, POLL_S, self.stopped)
            else:
                await asyncio.sleep(POLL_S)


async def measure(url: str, admin: str, agent_token: str, pid: int, mode: str, n: int, window: float) -> dict:
    agents = [IdleAgent(url, agent_token, f"idle{i}", mode) for i in range(n)]
    tasks = [asyncio.create_task(a.run()) for a in agents]
    await asyncio.sleep(10)  # registered, sockets connected, first claims answered
    c0, t0, k0 = cpu_seconds(pid), time.monotonic(), sum(a.claims for a in agents)
    await asyncio.sleep(window)
    c1, t1, k1 = cpu_seconds(pid), time.monotonic(), sum(a.claims for a in agents)
    async with httpx.AsyncClient(base_url=url, timeout=60, headers={"Authorization": f"Bearer {admin}"}) as c:
        submitted = time.time()
        (await c.post("/api/jobs", json={"name": "bench", "max_steps": 1})).raise_for_status()
    end = time.monotonic() + 60
    while time.monotonic() < end and not any(a.claimed_at for a in agents):
        await asyncio.sleep(0.05)
    first = min((a.claimed_at for a in agents if a.claimed_at), default=None)
    for a in agents:
        a.stopped.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"mode": mode, "cpu_pct": 100 * (c1 - c0) / (t1 - t0), "claims_per_s": (k1 - k0) / (t1 - t0),
            "first_claim_s": None if first is None else first - submitted}


def run_row(mode: str, n: int, window: float) -> dict:
    data, port = Path(tempfile.mkdtemp(prefix="tp-idle-")), free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "tokenpulse.cli", "server", "--data-dir", str(data),
                               "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        for _ in range(1200):
            try:
                if httpx.get(f"{url}/api/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        admin = (data / "token").read_text().strip()
        agent_token = (data / "agent_token").read_text().strip()
        return asyncio.run(measure(url, admin, agent_token, server.pid, mode, n, window))
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(data, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=100)
    ap.add_argument("--window", type=float, default=60.0, help="seconds of measurement per row")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    a = ap.parse_args()
    results = [run_row(mode, a.agents, a.window) for mode in a.rows.split(",")]
    print(f"\n{a.agents} idle agents, heartbeat every {HEARTBEAT_S:.0f} s, {a.window:.0f} s window per row; "
          f"server CPU time (user + system, all threads) / wall time, {os.cpu_count()} cores on this machine "
          "(other work beside it slows the run, not the CPU time it takes)\n")
    print("| agents speak | server CPU, % of one core | claims / s | first claim after a submit |")
    print("|---|---|---|---|")
    for r in results:
        first = "none in 60 s" if r["first_claim_s"] is None else f"{r['first_claim_s']:.2f} s"
        print(f"| {r['mode']} | {r['cpu_pct']:.1f}% | {r['claims_per_s']:.1f} | {first} |")


if __name__ == "__main__":
    main()
