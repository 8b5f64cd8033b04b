"""A real database for unit tests of server code (SQLite, or PostgreSQL with TOKENPULSE_TEST_DB=postgresql):
the schema comes from the migrations (as a server start makes it), and the session is the one the
functions under test write through."""
from __future__ import annotations

import contextlib
from pathlib import Path

from sqlalchemy.orm import Session

from server.db import make_engine, upgrade_to_head
from server.ingest.metrics import METRIC_KEYS
from server.models import Agent
from tests import pg


@contextlib.contextmanager
def migrated_session(tmp_path: Path):
    url = pg.database_url(tmp_path, "unit")
    METRIC_KEYS.ids.clear()  # the process-wide name -> id cache belongs to the previous database
    upgrade_to_head(url)
    engine = make_engine(url)
    try:
        with Session(engine) as s:
            yield s
    finally:
        engine.dispose()


def add_agent(s: Session, name: str = "a", capacity: int = 1, seen_at: float = 0.0) -> Agent:
    agent = Agent(name=name, host="h", device="cpu", capacity=capacity, state="online",
                  created_at=0.0, seen_at=seen_at)
    s.add(agent)
    s.flush()
    return agent
