"""Events waiting for the server's acknowledgement, numbered per job, journaled on disk.

The agent numbers each job's events (seq), appends them to a small journal file, and drops them
once the server acknowledges that seq. After a server restart or a network blip nothing is lost:
unacknowledged events are sent again, and the server stores each seq once. After an agent crash,
the journals left on disk are replayed at the next start.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional


class Outbox:
    def __init__(self, journal_dir: Path):
        self.dir = journal_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.pending: dict[int, list[dict]] = {}
        self.next_seq: dict[int, int] = {}
        self._files = {}

    def open_job(self, job_id: int, seq_start: int) -> None:
        self.next_seq[job_id] = max(seq_start, self.next_seq.get(job_id, 0))
        self.pending.setdefault(job_id, [])

    def add(self, job_id: int, kind: str, data: dict, t: Optional[float] = None) -> dict:
        seq = self.next_seq[job_id]
        self.next_seq[job_id] = seq + 1
        ev = {"kind": kind, "job_id": job_id, "seq": seq, "t": t or time.time(), "data": data}
        self.pending[job_id].append(ev)
        f = self._files.get(job_id)
        if f is None:
            f = self._files[job_id] = (self.dir / f"{job_id}.jsonl").open("a", buffering=1)
        f.write(json.dumps(ev) + "\n")
        return ev

    def batch(self, limit: int = 5000) -> list[dict]:
        out: list[dict] = []
        for evs in self.pending.values():
            out.extend(evs[: limit - len(out)])
            if len(out) >= limit:
                break
        return out

    def ack(self, acked: dict) -> None:
        for job_id, seq in acked.items():
            job_id = int(job_id)
            evs = self.pending.get(job_id)
            if evs:
                self.pending[job_id] = [e for e in evs if e["seq"] > seq]

    def size(self) -> int:
        return sum(len(v) for v in self.pending.values())

    def close_job(self, job_id: int) -> None:
        """Forget a finished job once all its events are acknowledged."""
        if self.pending.get(job_id):
            return
        self.pending.pop(job_id, None)
        f = self._files.pop(job_id, None)
        if f is not None:
            f.close()
        (self.dir / f"{job_id}.jsonl").unlink(missing_ok=True)

    def recover(self) -> None:
        """Load journals an earlier agent process left behind; their events are sent again."""
        for path in sorted(self.dir.glob("*.jsonl")):
            job_id = int(path.stem)
            evs = []
            for line in path.read_text().splitlines():
                try:
                    evs.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a line torn by the crash: everything before it is whole
            if evs:
                self.pending[job_id] = evs
                self.next_seq[job_id] = evs[-1]["seq"] + 1
