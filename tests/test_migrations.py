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


def test_0015_gives_each_stored_point_its_attempt_and_rebuilds_the_rollups(tmp_path):
    """Points stored before 0015 go to the attempt running when they were logged; the rollups are
    per attempt after it; a downgrade keeps the newest attempt's point at each step."""
    from alembic import command
    from sqlalchemy import text

    from server.db import alembic_config
    url = pg.database_url(tmp_path, "m15")
    command.upgrade(alembic_config(url), "0014")
    engine = create_engine(normalize_url(url))
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO jobs (id, name, state, spec, priority, created_at, attempt, next_seq) "
                              "VALUES (1, 'j', 'running', '{}', 0, 0, 2, 0)"))
            conn.execute(text("INSERT INTO attempts (job_id, attempt, started_at) VALUES (1, 1, 100), (1, 2, 200)"))
            conn.execute(text("INSERT INTO metric_keys (id, name) VALUES (1, 'loss')"))
            # steps 0-9 logged by attempt 1 (t 100+), steps 10-19 by attempt 2 (t 200+)
            conn.execute(text("INSERT INTO metrics (job_id, key_id, step, t, value) VALUES (1, 1, :s, :t, 1.0)"),
                         [{"s": s, "t": (100 if s < 10 else 200) + s} for s in range(20)])
        command.upgrade(alembic_config(url), "head")
        with engine.connect() as conn:
            by = dict(conn.execute(text("SELECT attempt, COUNT(*) FROM metrics GROUP BY attempt")).all())
            rolls = conn.execute(text("SELECT attempt, n, first_step, last_step FROM metric_rollups "
                                      "ORDER BY attempt")).all()
        assert by == {1: 10, 2: 10}
        assert [tuple(r) for r in rolls] == [(1, 10, 0, 9), (2, 10, 10, 19)]
        command.downgrade(alembic_config(url), "0014")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT COUNT(*) FROM metrics")).scalar() == 20
            assert conn.execute(text("SELECT n FROM metric_rollups")).scalar() == 20
    finally:
        engine.dispose()
