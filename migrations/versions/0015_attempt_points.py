"""metrics and metric_rollups per attempt: the primary keys become (job_id, key_id, attempt, step) and
(job_id, key_id, attempt, bucket), so a later attempt's point at a step never overwrites an earlier
attempt's. Points stored before this revision go to the attempt that was running when they were
logged (the newest attempt started at or before the point's time; the job's current attempt where
no attempt row says), and the rollups are rebuilt per attempt.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-28
"""
import sqlalchemy as sa
from alembic import op

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None

COLS = ("n", "first_step", "first_t", "first_value", "last_step", "last_t", "last_value",
        "min_step", "min_t", "min_value", "max_step", "max_t", "max_value")
# the attempt a stored point belongs to (self-contained SQL: a migration must not change with later code)
ATTEMPT_OF_POINT = ("COALESCE((SELECT MAX(a.attempt) FROM attempts a WHERE a.job_id = m.job_id "
                    "AND a.started_at <= m.t), (SELECT j.attempt FROM jobs j WHERE j.id = m.job_id), 0)")


def _int(name: str, sqlite: bool) -> sa.Column:
    # 64-bit on PostgreSQL (server/dialect.py's rule); SQLite's INTEGER is 64-bit already
    return sa.Column(name, sa.Integer() if sqlite else sa.BigInteger(), nullable=False)


def _rollups_table(keys: tuple, sqlite: bool) -> None:
    op.create_table(
        'metric_rollups', *[_int(k, sqlite) for k in keys],
        *[_int(c, sqlite) if c == "n" or c.endswith("_step") else sa.Column(c, sa.Float(), nullable=False)
          for c in COLS],
        sa.PrimaryKeyConstraint(*keys), sqlite_with_rowid=False)


def _fill_rollups(conn, keys: tuple) -> None:
    """A rollup row per 256 steps of each series (keys: the series' columns, then 'bucket')."""
    width = 256  # server.ingest.metrics.ROLLUP_SHIFT = 8
    series = ", ".join(keys[:-1])
    names = (*keys, *COLS)
    insert = sa.text(f"INSERT INTO metric_rollups ({', '.join(names)}) VALUES ({', '.join(':' + n for n in names)})")
    rows, cur_key, pts = [], None, []

    def flush():
        if pts:
            rows.append(dict(zip(names, (*cur_key, len(pts), *pts[0], *pts[-1], *min(pts, key=lambda x: x[2]),
                                         *max(pts, key=lambda x: x[2])))))
    for *ids, step, t, value in conn.exec_driver_sql(
            f"SELECT {series}, step, t, value FROM metrics ORDER BY {series}, step"):
        key = (*ids, step // width)
        if key != cur_key:
            flush()
            cur_key, pts = key, []
            if len(rows) >= 10_000:
                conn.execute(insert, rows)
                rows = []
        pts.append((step, t, value))
    flush()
    if rows:
        conn.execute(insert, rows)


def upgrade() -> None:
    conn = op.get_bind()
    sqlite = conn.dialect.name == "sqlite"
    op.create_table(
        'metrics_by_attempt', _int('job_id', sqlite), _int('key_id', sqlite), _int('attempt', sqlite),
        _int('step', sqlite), sa.Column('t', sa.Float(), nullable=False),
        sa.Column('value', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('job_id', 'key_id', 'attempt', 'step', name='pk_metrics_by_attempt'),
        sqlite_with_rowid=False)
    conn.exec_driver_sql(f"INSERT INTO metrics_by_attempt (job_id, key_id, attempt, step, t, value) "
                         f"SELECT m.job_id, m.key_id, {ATTEMPT_OF_POINT}, m.step, m.t, m.value FROM metrics m")
    op.drop_table('metric_rollups')
    op.drop_table('metrics')
    op.rename_table('metrics_by_attempt', 'metrics')
    if not sqlite:  # the constraint keeps the name it was made with: give it the table's usual one
        conn.exec_driver_sql("ALTER TABLE metrics RENAME CONSTRAINT pk_metrics_by_attempt TO metrics_pkey")
    _rollups_table(("job_id", "key_id", "attempt", "bucket"), sqlite)
    _fill_rollups(conn, ("job_id", "key_id", "attempt", "bucket"))


def downgrade() -> None:
    """Back to one point per (job, key, step): where attempts repeated a step, the newest attempt's
    point is kept (what the old schema stored)."""
    conn = op.get_bind()
    sqlite = conn.dialect.name == "sqlite"
    op.create_table(
        'metrics_by_step', _int('job_id', sqlite), _int('key_id', sqlite), _int('step', sqlite),
        sa.Column('t', sa.Float(), nullable=False), sa.Column('value', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('job_id', 'key_id', 'step', name='pk_metrics_by_step'), sqlite_with_rowid=False)
    conn.exec_driver_sql(
        "INSERT INTO metrics_by_step (job_id, key_id, step, t, value) SELECT m.job_id, m.key_id, m.step, m.t, "
        "m.value FROM metrics m JOIN (SELECT job_id, key_id, step, MAX(attempt) AS attempt FROM metrics "
        "GROUP BY job_id, key_id, step) newest ON newest.job_id = m.job_id AND newest.key_id = m.key_id "
        "AND newest.step = m.step AND newest.attempt = m.attempt")
    op.drop_table('metric_rollups')
    op.drop_table('metrics')
    op.rename_table('metrics_by_step', 'metrics')
    if not sqlite:
        conn.exec_driver_sql("ALTER TABLE metrics RENAME CONSTRAINT pk_metrics_by_step TO metrics_pkey")
    _rollups_table(("job_id", "key_id", "bucket"), sqlite)
    _fill_rollups(conn, ("job_id", "key_id", "bucket"))
