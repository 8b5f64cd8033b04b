"""Events waiting for the server's acknowledgement, numbered per job, journaled on disk.

The agent numbers each job's events (seq), appends them to a small journal file, and drops them
once the server acknowledges that seq. After a server restart or a network blip nothing is lost:
unacknowledged events are sent again, and the server stores each seq once. After an agent crash,
the journals left on disk are replayed at the next start.

The journal stays small on long runs: once the acknowledged lines outnumber the pending ones it is
rewritten (to a temp file, then renamed: a crash mid-rewrite leaves the old journal whole), and it is
emptied whenever everything is acknowledged.

A journal write that fails (ENOSPC: the disk is full; or any other OSError) never raises into the
caller: the event stays pending in memory and is still sent, `disk_error` says why, and the next
add() after space returns rewrites the whole journal from memory (a temp file, then renamed), which
also drops the torn line the failed write may have left. Nothing already journaled is lost.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Optional, TextIO

from worker.agent.disk import disk_words
from worker.agent.masking import SecretMask

log = logging.getLogger("tokenpulse.outbox")

BATCH_EVENTS = 5000
BATCH_BYTES = 4 << 20  # well under the server's body limit (16 MiB by default)
COMPACT_AFTER = 2000  # acknowledged lines tolerated in a journal before it is rewritten


class Outbox:
    def __init__(self, journal_dir: Path):
        self.dir = journal_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.pending: dict[int, list[dict]] = {}
        self.masks: dict[int, SecretMask] = {}  # a command job's secret_env values
        self.next_seq: dict[int, int] = {}
        self.lines: dict[int, int] = {}  # lines in each journal file (pending + acknowledged)
        self._files: dict[int, TextIO] = {}  # each job's journal, open for appending
        self.disk_error: Optional[str] = None  # why the journal cannot be written now (None: it can)
        self._unjournaled: set[int] = set()  # jobs whose journal misses pending events
        self._retry_at = 0.0

    def path(self, job_id: int) -> Path:
        return self.dir / f"{job_id}.jsonl"

    def open_job(self, job_id: int, seq_start: int, mask: Optional[SecretMask] = None) -> None:
        """mask: the job's secret values, masked in every event added (the one way events leave the
        agent, journal included), whatever field or key they hide in."""
        self.next_seq[job_id] = max(seq_start, self.next_seq.get(job_id, 0))
        self.pending.setdefault(job_id, [])
        if mask:
            self.masks[job_id] = mask

    def _file(self, job_id: int):
        f = self._files.get(job_id)
        if f is None:
            f = self._files[job_id] = self.path(job_id).open("a", buffering=1)
        return f

    def add(self, job_id: int, kind: str, data: dict, t: Optional[float] = None) -> dict:
        mask = self.masks.get(job_id)
        if mask is not None:
            data = mask.data(data)
        seq = self.next_seq[job_id]
        self.next_seq[job_id] = seq + 1
        ev = {"kind": kind, "job_id": job_id, "seq": seq, "t": t or time.time(), "data": data}
        self.pending.setdefault(job_id, []).append(ev)
        if job_id in self._unjournaled:
            if time.monotonic() >= self._retry_at:  # not a full rewrite per event while the disk is full
                self._rewrite(job_id)
            return ev  # journaled by the rewrite, or kept in memory and sent all the same
        try:
            # Line-buffered: each event reaches the OS before add() returns, so kill -9 of the agent
            # loses none (a machine crash can lose the last page; fsync per event would cost too much).
            self._file(job_id).write(json.dumps(ev) + "\n")
            self.lines[job_id] = self.lines.get(job_id, 0) + 1
        except OSError as e:
            self._failed(job_id, e)
        return ev

    def _failed(self, job_id: int, e: OSError) -> None:
        f = self._files.pop(job_id, None)
        if f is not None:
            try:
                f.close()  # flushing what is buffered may fail again; the descriptor closes anyway
            except OSError:
                pass
        self._unjournaled.add(job_id)
        self._retry_at = time.monotonic() + 1.0
        why = disk_words(self.dir, e)
        if self.disk_error is None:
            log.error("journal: %s; events are kept in memory (and still sent) until it can be written "
                      "again", why)
        self.disk_error = why

    def _close(self, job_id: int) -> None:
        f = self._files.pop(job_id, None)
        if f is not None:
            try:
                f.close()
            except OSError:
                pass  # a full disk can fail the final flush: what was lost is rewritten from memory

    def _rewrite(self, job_id: int) -> bool:
        """The journal from memory: every pending event, to a temp file renamed over the old one.
        False (and the old journal untouched) when it still cannot be written."""
        pending = self.pending.get(job_id, [])
        self._close(job_id)
        tmp = self.path(job_id).with_suffix(".tmp")
        try:
            with tmp.open("w") as out:
                out.writelines(json.dumps(e) + "\n" for e in pending)
            os.replace(tmp, self.path(job_id))
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self._failed(job_id, e)
            return False
        self.lines[job_id] = len(pending)
        if job_id in self._unjournaled:
            self._unjournaled.discard(job_id)
            if not self._unjournaled and self.disk_error is not None:
                log.warning("journal: writable again (%s); %s pending events journaled", self.dir, len(pending))
                self.disk_error = None
        return True

    def retry_journal(self) -> bool:
        """Try again to journal what only memory holds (called now and then); True when all is written."""
        if self._unjournaled and time.monotonic() >= self._retry_at:
            for job_id in list(self._unjournaled):
                self._rewrite(job_id)
        return not self._unjournaled

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

    def forget(self, job_id: int) -> int:
        """Drop every pending event of a job (an attempt the server has ended: job_run.take_back);
        returns how many."""
        n = len(self.pending.get(job_id) or [])
        if n:
            self.pending[job_id] = []
            self._rewrite(job_id)
        return n

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
        self._rewrite(job_id)

    def size(self) -> int:
        return sum(len(v) for v in self.pending.values())

    def close_job(self, job_id: int) -> None:
        """Forget a finished job once all its events are acknowledged."""
        if self.pending.get(job_id):
            return
        self.pending.pop(job_id, None)
        self.masks.pop(job_id, None)
        self.lines.pop(job_id, None)
        self._unjournaled.discard(job_id)
        if not self._unjournaled:
            self.disk_error = None
        self._close(job_id)
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
