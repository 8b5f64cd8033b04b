"""The schema's history and the models agree."""
from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from server.db import upgrade_to_head
from server.models import Base


def test_upgrade_from_empty_to_head_matches_models(tmp_path):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    upgrade_to_head(url)
    engine = create_engine(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == [], f"models and migrations differ: {diff}"
    tables = set(inspect(engine).get_table_names())
    assert {"jobs", "agents", "events", "metrics", "alerts", "tokens", "attempts"} <= tables
    upgrade_to_head(url)  # a second start is a no-op, not an error
