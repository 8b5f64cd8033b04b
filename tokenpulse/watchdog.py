"""The watchdog of a script started by hand: `python -m tokenpulse.watchdog` (started by
tokenpulse.init, never by a person).

It is to an external job what an agent is to a command job: it reads the script's events from a
pipe (its stdin; the script writes them with the same Emitter as under an agent), numbers them and
sends them in batches to the server (POST /api/jobs/{id}/events), resending until acknowledged. In
its own process, so it keeps working when the script is stuck (even holding the GIL) and can say
how the script ended when it dies without a word. It watches progress with the agents' stall
detector (tokenpulse/diagnosis/stall.py: thresholds from TOKENPULSE_STALL_* or init(stall={...})); on a
stall it captures every thread's stack on the agents' ladder (tokenpulse/diagnosis/capture.py: py-spy,
or where py-spy cannot attach, the script's faulthandler dump to a file on SIGUSR1) and raises a
stalled alert naming the line it is stuck on.
Server commands: cancel (SIGTERM to the script), stack (a dump as a log line).
"""
from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import sys
import threading
import time
from typing import Optional

import httpx

from tokenpulse.diagnosis.capture import capture_stack
from tokenpulse.diagnosis.stall import StallConfig, StallDetector, stuck_at

SEND_EVERY_S = 0.5
ALIVE_EVERY_S = 2.0
URGENT = {"phase", "state", "alert", "checkpoint"}
MAX_BATCH = 2000
MAX_PENDING = 200_000  # the server unreachable for long: keep memory bounded, drop the oldest


class Watchdog:
    def __init__(self, hello: dict, out):
        self.hello, self.out = hello, out
        self.pid = int(hello["pid"])
        self.url = os.environ["TOKENPULSE_URL"].rstrip("/")
        token = os.environ.get("TOKENPULSE_TOKEN", "")
        self.http = httpx.Client(base_url=self.url, timeout=30, headers={"Authorization": f"Bearer {token}"})
        self.lines: queue.Queue = queue.Queue()
        self.pending: list[dict] = []  # numbered, not yet acknowledged
        self.seq = 0
        self.alive_t: Optional[float] = None
        self.ended = False  # the script's pipe closed
        self.state_sent = False
        self.detector = StallDetector(StallConfig.from_env().merged(hello.get("stall") or {}))
        self.stack_file = hello.get("stack_file")
        self.job_id: Optional[int] = None

    # ---- setup ---------------------------------------------------------------------------------
    def create_job(self) -> bool:
        run = {k: self.hello.get(k) for k in ("name", "config", "command", "host", "pid", "cwd")}
        try:
            r = self.http.post("/api/jobs/external", json={k: v for k, v in run.items() if v is not None})
        except httpx.HTTPError as e:
            self.answer({"error": f"cannot reach {self.url}: {e}"})
            return False
        if r.status_code != 201:
            self.answer({"error": f"{self.url} refused the run ({r.status_code}): {r.text[:500]}"})
            return False
        created = r.json()
        self.job_id = created["id"]
        # The job's own credential: only it may post this job's events (the user token that created
        # the job is not needed, nor sent, again).
        self.http.headers["Authorization"] = f"Bearer {created['report_token']}"
        self.answer({"id": self.job_id, "url": f"{self.url}/jobs/{self.job_id}"})
        return True

    def answer(self, d: dict) -> None:
        self.out.write(json.dumps(d) + "\n")
        self.out.flush()

    # ---- the loop ------------------------------------------------------------------------------
    def read(self, stream) -> None:
        for raw in stream:
            self.lines.put(raw)
        self.lines.put(None)

    def run(self, stream) -> None:
        threading.Thread(target=self.read, args=(stream,), daemon=True).start()
        self.detector.start(time.time())
        last_send = 0.0
        while not self.ended:
            urgent = self.drain(timeout=0.25)
            now = time.time()
            if not self.ended:
                self.watch(now)
            if urgent or now - last_send >= SEND_EVERY_S or self.ended:
                if self.pending or (self.alive_t and now - last_send >= ALIVE_EVERY_S) or self.ended:
                    self.send()
                    last_send = now
        if not self.state_sent:
            self.say_how_it_ended()
        deadline = time.time() + 60
        while self.pending and time.time() < deadline:  # the last events, until acknowledged
            if not self.send():
                time.sleep(1)

    def drain(self, timeout: float) -> bool:
        urgent = False
        try:
            raw = self.lines.get(timeout=timeout)
        except queue.Empty:
            return False
        while True:
            if raw is None:
                self.ended = True
                return True
            urgent = self.take(raw) or urgent
            try:
                raw = self.lines.get_nowait()
            except queue.Empty:
                return urgent

    def take(self, raw: str) -> bool:
        try:
            e = json.loads(raw)
            kind, t, data = e["kind"], float(e["t"]), e.get("data") or {}
        except (ValueError, KeyError, TypeError):
            return False
        recovered = self.detector.observe(kind, data, time.time())
        if recovered is not None:
            self.add("alert", {"kind": "stalled", "message": recovered.message, "clear": True})
        if kind == "alive":
            self.alive_t = t
            return False
        if kind == "state":
            self.state_sent = True
        self.add(kind, data, t)
        return kind in URGENT

    def add(self, kind: str, data: dict, t: Optional[float] = None) -> None:
        if len(self.pending) >= MAX_PENDING:
            del self.pending[:MAX_PENDING // 10]
        self.pending.append({"kind": kind, "job_id": self.job_id, "seq": self.seq, "t": t or time.time(),
                             "data": data})
        self.seq += 1

    def send(self) -> bool:
        batch = self.pending[:MAX_BATCH]
        if self.alive_t is not None:  # liveness rides along, unnumbered (the server does not store it)
            batch = batch + [{"kind": "alive", "job_id": self.job_id, "seq": 0, "t": self.alive_t, "data": {}}]
        if not batch:
            return True
        try:
            r = self.http.post(f"/api/jobs/{self.job_id}/events", json={"events": batch})
        except httpx.HTTPError:
            return False
        if r.status_code == 422:
            self.drop_refused(r)  # a malformed event must not block the rest forever
            return False
        if r.status_code != 200:
            return False
        reply = r.json()
        acked = reply.get("acked", {}).get(str(self.job_id))
        if acked is not None:
            self.pending = [e for e in self.pending if e["seq"] > acked]
        for c in reply.get("commands", []):
            self.command(c.get("action"))
        return True

    def drop_refused(self, r: httpx.Response) -> None:
        """The server names the refused event (loc: body, events, i, ...): drop that one."""
        try:
            loc = r.json()["detail"][0]["loc"]
            i = int(loc[loc.index("events") + 1])
        except (ValueError, KeyError, IndexError, TypeError):
            i = 0
        if i < len(self.pending):
            del self.pending[i]

    # ---- stalls and commands -----------------------------------------------------------------
    def watch(self, now: float) -> None:
        v = self.detector.check(now)
        if v is None or v.kind != "stalled":
            return
        stack = self.capture_stack()
        where = stuck_at(stack)
        self.add("alert", {"kind": "stalled", "severity": "critical",
                           "message": v.message + (f"; stuck at {where}" if where else ""),
                           "stack": stack[-199_000:] if stack else None})

    def capture_stack(self) -> str:
        """Every thread's stack, on the agents' ladder; the script's faulthandler writes to its stack file."""
        return asyncio.run(capture_stack(self.pid, self.faulthandler_dump if self.stack_file else None,
                                         "the script has no stack file"))

    async def faulthandler_dump(self) -> str:
        """SIGUSR1 makes the script's faulthandler append every thread's stack to its stack file."""
        try:
            before = os.path.getsize(self.stack_file)
            os.kill(self.pid, signal.SIGUSR1)
            deadline, size = time.time() + 3, before
            while time.time() < deadline:
                await asyncio.sleep(0.3)
                now_size = os.path.getsize(self.stack_file)
                if now_size > before and now_size == size:
                    break  # lines stopped arriving: the dump is complete
                size = now_size
            with open(self.stack_file, "rb") as f:
                f.seek(before)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def command(self, action: Optional[str]) -> None:
        if action == "cancel" and not self.ended:
            self.add("log", {"line": "watchdog: cancel requested; sending SIGTERM to the script", "stream": "agent"})
            self.cancelled = True
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        elif action == "stack":
            self.add("log", {"line": self.capture_stack()[:8000], "stream": "agent"})

    cancelled = False

    def say_how_it_ended(self) -> None:
        """The script's pipe closed without a final state: it was killed or exited abruptly."""
        if self.cancelled:
            self.add("state", {"state": "cancelled", "reason": "cancelled by user; the script was sent SIGTERM"})
            return
        self.add("alert", {"kind": "crashed", "severity": "critical",
                           "message": f"the script (pid {self.pid}) ended without reporting how: killed "
                                      f"(SIGKILL, the OOM killer) or os._exit; last progress: {self.detector.where()}"})
        self.add("state", {"state": "failed", "failure": "crash",
                           "reason": f"the script (pid {self.pid}) ended without a final report"})


def main() -> int:
    # Ctrl-C in the script's terminal is for the script: the watchdog must outlive it to report.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdin = sys.stdin
    first = stdin.readline()
    try:
        hello = json.loads(first)
    except ValueError:
        return 2
    w = Watchdog(hello, sys.stdout)
    if not w.create_job():
        return 1
    w.run(stdin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
