"""metric_rollups (first/last/min/max per 256 steps, for fast downsampled charts), filled from the
existing points; an index on jobs.agent_id (heartbeats and event batches look up an agent's jobs)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""
import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None

COLS = ("n", "first_step", "first_t", "first_value", "last_step", "last_t", "last_value",
        "min_step", "min_t", "min_value", "max_step", "max_t", "max_value")


def upgrade() -> None:
    op.create_table(
        'metric_rollups',
        sa.Column('job_id', sa.Integer(), nullable=False),
        sa.Column('key_id', sa.Integer(), nullable=False),
        sa.Column('bucket', sa.Integer(), nullable=False),
        *[sa.Column(c, sa.Integer() if c == "n" or c.endswith("_step") else sa.Float(), nullable=False)
          for c in COLS],
        sa.PrimaryKeyConstraint('job_id', 'key_id', 'bucket'),
        sqlite_with_rowid=False,
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_jobs_agent_id'), ['agent_id'], unique=False)
    # Points stored before this revision get their rollups, so old runs chart fast too.
    conn = op.get_bind()
    width = 256  # server.ingest.metrics.ROLLUP_SHIFT = 8

    def aggregate(p):  # self-contained on purpose: a migration must not change with later code
        return [len(p), *p[0], *p[-1], *min(p, key=lambda x: x[2]), *max(p, key=lambda x: x[2])]
    rows, cur_key, pts = [], None, []

    def flush():
        if pts:
            rows.append((*cur_key, *aggregate(pts)))
    for job_id, key_id, step, t, value in conn.exec_driver_sql(
            "SELECT job_id, key_id, step, t, value FROM metrics ORDER BY job_id, key_id, step"):
        key = (job_id, key_id, step // width)
        if key != cur_key:
            flush()
            cur_key, pts = key, []
        pts.append((step, t, value))
    flush()
    if rows:  # named parameters: the same statement on SQLite and PostgreSQL
        names = ("job_id", "key_id", "bucket", *COLS)
        conn.execute(sa.text(f"INSERT INTO metric_rollups ({', '.join(names)}) "
                             f"VALUES ({', '.join(':' + n for n in names)})"),
                     [dict(zip(names, r)) for r in rows])


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_jobs_agent_id'))
    op.drop_table('metric_rollups')
