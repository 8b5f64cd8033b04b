"""CPU of an idle server and an idle agent: what a dashboard left running costs, and what every test
that keeps a server up pays (the suite runs several side by side). A real server on a fresh SQLite
file and one agent (heartbeat 1 s, as the tests run it), started, then left idle.

    python bench/idle_server.py [--seconds 30]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from conftest import make_server, wait_for  # noqa: E402


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0)
    args = ap.parse_args()
    s = make_server(Path(tempfile.mkdtemp(prefix="tp-idle-"))).start()
    a = s.start_agent("a1")
    try:
        with s.client() as c:
            wait_for(lambda: c.get("/api/agents").json(), 60, "the agent to register")
        time.sleep(3)  # past the start-up work
        s0, a0 = cpu_s(s.proc.pid), cpu_s(a.pid)
        time.sleep(args.seconds)
        s1, a1 = cpu_s(s.proc.pid), cpu_s(a.pid)
    finally:
        a.terminate()
        a.wait()
        s.kill()
    print(f"| process | CPU-s in {args.seconds:g} s idle | share of a core |")
    print("|---|---|---|")
    for name, used in (("server", s1 - s0), ("agent", a1 - a0)):
        print(f"| {name} | {used:.2f} | {100 * used / args.seconds:.1f} % |")


if __name__ == "__main__":
    main()
