"""The schema's history and the models agree, on SQLite and on PostgreSQL."""
from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from server.db import upgrade_to_head
from server.dialect import compare_type, normalize_url
from server.models import Base
from tests import pg


def check_head_matches_models(url: str) -> None:
    upgrade_to_head(url)
    engine = create_engine(normalize_url(url))
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": compare_type})
            diff = compare_metadata(ctx, Base.metadata)
        assert diff == [], f"models and migrations differ: {diff}"
        tables = set(inspect(engine).get_table_names())
        assert {"jobs", "agents", "events", "metrics", "alerts", "tokens", "attempts"} <= tables
    finally:
        engine.dispose()
    upgrade_to_head(url)  # a second start is a no-op, not an error


def test_upgrade_from_empty_to_head_matches_models(tmp_path):
    check_head_matches_models(pg.database_url(tmp_path, "m"))


@pytest.mark.skipif(pg.bin_dir() is None, reason="PostgreSQL is not installed (make setup installs it)")
def test_every_migration_runs_on_postgresql():
    """Always checked where PostgreSQL is installed, whatever store the run uses: every revision's
    DDL and data steps run on PostgreSQL, and integers are 64-bit there as in SQLite."""
    url = pg.cluster().create_database("mig")
    check_head_matches_models(url)
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            cols = {c["name"]: c["type"] for c in inspect(conn).get_columns("metrics")}
        assert cols["step"].__class__.__name__ == "BIGINT", cols
    finally:
        engine.dispose()
