"""One reaper among several server processes on one PostgreSQL: a session advisory lock.

The process whose own connection holds the lock runs the reaper; the others try again at each
pass. PostgreSQL releases the lock when that connection ends (the process stopped, crashed, or
lost its network), so another process takes over within a pass. With SQLite there is one process:
it always leads.
"""
from __future__ import annotations

import logging

log = logging.getLogger("tokenpulse.leader")
REAPER_LOCK = 0x746F6B70  # "tokp": the advisory lock key every tokenpulse process agrees on


class ReaperLock:
    def __init__(self, url: str):
        self.url = url
        self.conn = None
        self.held = False

    async def acquire(self) -> bool:
        """True while this process holds the lock (checked alive, or newly won)."""
        import psycopg

        from server.relay import conninfo
        try:
            if self.conn is None or self.conn.closed:
                self.held = False
                self.conn = await psycopg.AsyncConnection.connect(conninfo(self.url), autocommit=True)
            if self.held:
                await self.conn.execute("SELECT 1")  # the lock lives as long as this connection
            else:
                cur = await self.conn.execute("SELECT pg_try_advisory_lock(%s)", (REAPER_LOCK,))
                self.held = bool((await cur.fetchone())[0])
                if self.held:
                    log.info("this server process runs the reaper")
        except Exception:  # noqa: BLE001 - a lost connection lost the lock too; retry next pass
            log.warning("reaper lock: connection failed; not reaping this pass", exc_info=True)
            self.held = False
            if self.conn is not None:
                try:
                    await self.conn.close()
                except Exception:  # noqa: BLE001
                    pass
            self.conn = None
        return self.held

    async def close(self) -> None:
        if self.conn is not None:
            await self.conn.close()
        self.held = False
