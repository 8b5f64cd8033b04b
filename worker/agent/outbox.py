"""Events waiting for the server's acknowledgement, numbered per job, journaled on disk.

The agent numbers each job's events (seq), appends them to a small journal file, and drops them
once the server acknowledges that seq. After a server restart or a network blip nothing is lost:
unacknowledged events are sent again, and the server stores each seq once. After an agent crash,
the journals left on disk are replayed at the next start.

The journal stays small on long runs: once the acknowledged lines outnumber the pending ones it is
rewritten (to a temp file, then renamed: a crash mid-rewrite leaves the old journal whole), and it is
emptied whenever everything is acknowledged.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger("tokenpulse.outbox")

BATCH_EVENTS = 5000
BATCH_BYTES = 4 << 20  # well under the server's body limit (16 MiB by default)
COMPACT_AFTER = 2000  # acknowledged lines tolerated in a journal before it is rewritten


class Outbox:
    def __init__(self, journal_dir: Path):
        self.dir = journal_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.pending: dict[int, list[dict]] = {}
        self.next_seq: dict[int, int] = {}
        self.lines: dict[int, int] = {}  # lines in each journal file (pending + acknowledged)
        self._files = {}

    def path(self, job_id: int) -> Path:
        return self.dir / f"{job_id}.jsonl"

    def open_job(self, job_id: int, seq_start: int) -> None:
        self.next_seq[job_id] = max(seq_start, self.next_seq.get(job_id, 0))
        self.pending.setdefault(job_id, [])

    def _file(self, job_id: int):
        f = self._files.get(job_id)
        if f is None:
            f = self._files[job_id] = self.path(job_id).open("a", buffering=1)
        return f

    def add(self, job_id: int, kind: str, data: dict, t: Optional[float] = None) -> dict:
        seq = self.next_seq[job_id]
        self.next_seq[job_id] = seq + 1
        ev = {"kind": kind, "job_id": job_id, "seq": seq, "t": t or time.time(), "data": data}
        self.pending.setdefault(job_id, []).append(ev)
        # Line-buffered: each event reaches the OS before add() returns, so kill -9 of the agent
        # loses none (a machine crash can lose the last page; fsync per event would cost too much).
        self._file(job_id).write(json.dumps(ev) + "\n")
        self.lines[job_id] = self.lines.get(job_id, 0) + 1
        return ev

    def batch(self, limit: int = BATCH_EVENTS, max_bytes: int = BATCH_BYTES) -> list[dict]:
        """The oldest pending events, in seq order per job, at most `limit` and about `max_bytes`."""
        out: list[dict] = []
        size = 0
        for evs in self.pending.values():
            for ev in evs:
                if len(out) >= limit:
                    return out
                n = len(json.dumps(ev["data"])) + 100
                if out and size + n > max_bytes:
                    return out
                out.append(ev)
                size += n
        return out

    def ack(self, acked: dict) -> None:
        for job_id, seq in acked.items():
            job_id = int(job_id)
            evs = self.pending.get(job_id)
            if evs:
                self.pending[job_id] = [e for e in evs if e["seq"] > seq]
                self._compact(job_id)

    def drop(self, ev: dict, why: str) -> None:
        """Give up on one event the server refuses outright (malformed or too large alone)."""
        evs = self.pending.get(ev["job_id"], [])
        self.pending[ev["job_id"]] = [e for e in evs if e["seq"] != ev["seq"]]
        log.error("job %s: dropped event seq %s (%s): %s", ev["job_id"], ev["seq"], ev["kind"], why[:300])
        self._compact(ev["job_id"])

    def _compact(self, job_id: int) -> None:
        pending = self.pending.get(job_id, [])
        lines = self.lines.get(job_id, 0)
        if lines - len(pending) < (COMPACT_AFTER if pending else 200):
            return  # not worth a rewrite yet
        f = self._files.pop(job_id, None)
        if f is not None:
            f.close()
        tmp = self.path(job_id).with_suffix(".tmp")
        with tmp.open("w") as out:
            out.writelines(json.dumps(e) + "\n" for e in pending)
        os.replace(tmp, self.path(job_id))
        self.lines[job_id] = len(pending)

    def size(self) -> int:
        return sum(len(v) for v in self.pending.values())

    def close_job(self, job_id: int) -> None:
        """Forget a finished job once all its events are acknowledged."""
        if self.pending.get(job_id):
            return
        self.pending.pop(job_id, None)
        self.lines.pop(job_id, None)
        f = self._files.pop(job_id, None)
        if f is not None:
            f.close()
        self.path(job_id).unlink(missing_ok=True)

    def recover(self) -> None:
        """Load journals an earlier agent process left behind; their events are sent again."""
        for tmp in self.dir.glob("*.tmp"):  # a rewrite the crash interrupted: the journal is intact
            tmp.unlink(missing_ok=True)
        for path in sorted(self.dir.glob("*.jsonl")):
            try:
                job_id = int(path.stem)
            except ValueError:
                continue
            evs = []
            for line in path.read_text().splitlines():
                try:
                    evs.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a line torn by the crash: everything before it is whole
            if evs:
                self.pending[job_id] = evs
                self.next_seq[job_id] = max(self.next_seq.get(job_id, 0), evs[-1]["seq"] + 1)
                self.lines[job_id] = len(evs)
