"""Projects, tags and notes on jobs; sweeps and their trials (issue 32)

jobs.project (every job in one; 'default' unless chosen), jobs.tags (a JSON list), jobs.note
(markdown), jobs.sweep_id (a sweep's trial). sweeps: the sweep as submitted and its course;
sweep_trials: each trial's settings, Optuna's per-trial state (system_attrs: the grid point, a
pruner's rungs) and outcome, so the Optuna study is rebuilt from them after a restart.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-28
"""
import sqlalchemy as sa
from alembic import op

revision = '0016'
# after 0015 (metric points per attempt)
down_revision = '0015'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as b:
        b.add_column(sa.Column('project', sa.String(100), nullable=False, server_default='default'))
        b.add_column(sa.Column('tags', sa.Text(), nullable=True))
        b.add_column(sa.Column('note', sa.Text(), nullable=True))
        b.add_column(sa.Column('sweep_id', sa.Integer(), nullable=True))
    op.create_index('ix_jobs_project', 'jobs', ['project'])
    op.create_index('ix_jobs_sweep_id', 'jobs', ['sweep_id'])
    op.create_table(
        'sweeps',
        sa.Column('id', sa.Integer(), primary_key=True),
        sa.Column('name', sa.String(200), nullable=False),
        sa.Column('project', sa.String(100), nullable=False),
        sa.Column('state', sa.String(16), nullable=False),
        sa.Column('spec', sa.Text(), nullable=False),
        sa.Column('owner_token_id', sa.Integer(), nullable=True),
        sa.Column('reason', sa.Text(), nullable=True),
        sa.Column('created_at', sa.Float(), nullable=False),
        sa.Column('finished_at', sa.Float(), nullable=True),
    )
    op.create_table(
        'sweep_trials',
        sa.Column('sweep_id', sa.Integer(), sa.ForeignKey('sweeps.id'), primary_key=True),
        sa.Column('number', sa.Integer(), primary_key=True),
        sa.Column('job_id', sa.Integer(), sa.ForeignKey('jobs.id'), nullable=False),
        sa.Column('params', sa.Text(), nullable=False),
        sa.Column('system_attrs', sa.Text(), nullable=False),
        sa.Column('state', sa.String(16), nullable=False),
        sa.Column('value', sa.Float(), nullable=True),
        sa.Column('pruned_step', sa.Integer(), nullable=True),
        sa.Column('reason', sa.Text(), nullable=True),
        sa.Column('created_at', sa.Float(), nullable=False),
        sa.Column('finished_at', sa.Float(), nullable=True),
    )


def downgrade() -> None:
    op.drop_table('sweep_trials')
    op.drop_table('sweeps')
    op.drop_index('ix_jobs_sweep_id', 'jobs')
    op.drop_index('ix_jobs_project', 'jobs')
    with op.batch_alter_table('jobs') as b:
        for c in ('sweep_id', 'note', 'tags', 'project'):
            b.drop_column(c)
