"""Each job's log is kept whole up to `log_max_bytes` (server/settings.py); past it the oldest lines go,
a tenth of the bound at a time, so a job printing forever cannot fill the disk and a long job keeps
its newest output. Bytes are counted per job in this process (the first batch of a job after a start
reads its stored total once); deletes run on the writer thread, inside the batch's transaction."""
from __future__ import annotations

from server.dialect import raw_cursor

LIMIT = 64 * 1024 * 1024  # set from Settings.log_max_bytes at start (server/app.py)


class LogBudget:
    def __init__(self):
        self.used: dict[int, int] = {}  # job id -> stored log bytes (the events' JSON)

    def add(self, s, job_id: int, nbytes: int) -> None:
        """A batch brings nbytes of log lines to this job; trim its oldest lines when over the bound."""
        cur = raw_cursor(s)
        used = self.used.get(job_id)
        if used is None:
            used = cur.execute("SELECT COALESCE(SUM(LENGTH(data)), 0) FROM events WHERE job_id = ? AND kind = 'log'",
                               (job_id,)).fetchone()[0]
            if len(self.used) > 10_000:
                self.used.clear()
        used += nbytes
        if used > LIMIT:
            used -= self.trim(cur, job_id, used - int(LIMIT * 0.9))
        self.used[job_id] = used

    @staticmethod
    def trim(cur, job_id: int, excess: int) -> int:
        """Delete the oldest log rows holding at least `excess` bytes; returns the bytes deleted."""
        freed, last = 0, None
        for seq, n in cur.execute("SELECT seq, LENGTH(data) FROM events WHERE job_id = ? AND kind = 'log' "
                                  "ORDER BY seq", (job_id,)).fetchall():
            freed, last = freed + n, seq
            if freed >= excess:
                break
        if last is not None:
            cur.execute("DELETE FROM events WHERE job_id = ? AND kind = 'log' AND seq <= ?", (job_id, last))
        return freed


BUDGET = LogBudget()
