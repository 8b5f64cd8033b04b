#!/usr/bin/env python3
"""Idle agents: N real agents (worker.agent.Agent, in one asyncio process) with no job, against a
real server; the server's CPU over a window once they are registered and connected.

    .venv/bin/python bench/idle_agents.py --agents 100
    .venv/bin/python bench/idle_agents.py --agents 100 --root ../other-checkout   # the same, other code

An idle agent on its websocket claims only when the server says a job waits (a push when one is
queued, or a heartbeat's "work"); over HTTP alone it polls a claim every second.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=100)
    ap.add_argument("--window", type=float, default=20.0, help="seconds of measurement")
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                    help="the checkout whose server and agent run")
    a = ap.parse_args()
    root = a.root.resolve()
    sys.path.insert(0, str(root))
    data, port = Path(tempfile.mkdtemp(prefix="tp-idle-")), free_port()
    server = subprocess.Popen([sys.executable, "-m", "tokenpulse.cli", "server", "--data-dir", str(data / "data"),
                               "--port", str(port)], cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        import httpx
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        token = (data / "data" / "agent_token").read_text().strip()
        from worker.agent import Agent

        async def run() -> float:
            agents = [Agent(f"http://127.0.0.1:{port}", token, data / f"work{i}", name=f"idle{i}", heartbeat_s=2.0)
                      for i in range(a.agents)]
            tasks = [asyncio.create_task(x.run()) for x in agents]
            await asyncio.sleep(15)  # registered, first claims answered, sockets connected
            c0, t0 = cpu_of(server.pid), time.time()
            await asyncio.sleep(a.window)
            c1, t1 = cpu_of(server.pid), time.time()
            for t in tasks:
                t.cancel()
            return 100 * (c1 - c0) / (t1 - t0)
        pct = asyncio.run(run())
        print(f"| {a.agents} idle agents, heartbeat every 2 s | server CPU {pct:.1f}% of a core | {root.name} |")
    finally:
        server.kill()


if __name__ == "__main__":
    main()
