"""job_ranks: per-rank telemetry of distributed jobs (host, pid, device, step, step time, memory);
gang_members and jobs.nnodes: the agents sharing a multi-node job

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23
"""
import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch_op:
        batch_op.add_column(sa.Column('nnodes', sa.Integer(), nullable=False, server_default='1'))
    op.create_table(
        'job_ranks',
        sa.Column('job_id', sa.Integer(), sa.ForeignKey('jobs.id'), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False),
        sa.Column('agent_id', sa.Integer(), nullable=True),
        sa.Column('host', sa.String(200), nullable=True),
        sa.Column('pid', sa.Integer(), nullable=True),
        sa.Column('device', sa.String(200), nullable=True),
        sa.Column('step', sa.Integer(), nullable=True),
        sa.Column('step_time_s', sa.Float(), nullable=True),
        sa.Column('busy_s', sa.Float(), nullable=True),
        sa.Column('rss_mb', sa.Float(), nullable=True),
        sa.Column('alive_at', sa.Float(), nullable=True),
        sa.Column('progress_at', sa.Float(), nullable=True),
        sa.Column('exit', sa.String(200), nullable=True),
        sa.Column('updated_at', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('job_id', 'rank'),
    )


    op.create_table(
        'gang_members',
        sa.Column('job_id', sa.Integer(), sa.ForeignKey('jobs.id'), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False),
        sa.Column('node_rank', sa.Integer(), nullable=False),
        sa.Column('agent_id', sa.Integer(), nullable=False),
        sa.Column('endpoint', sa.String(300), nullable=True),
        sa.Column('joined_at', sa.Float(), nullable=False),
        sa.Column('handed_at', sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint('job_id', 'attempt', 'node_rank'),
    )
    op.create_index('ix_gang_members_agent_id', 'gang_members', ['agent_id'])


def downgrade() -> None:
    op.drop_index('ix_gang_members_agent_id', 'gang_members')
    op.drop_table('gang_members')
    op.drop_table('job_ranks')
    with op.batch_alter_table('jobs') as batch_op:
        batch_op.drop_column('nnodes')
