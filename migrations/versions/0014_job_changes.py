"""job_changes: every fix applied to a job (who, what, when, from which verdict, the measured effect),
and alerts.data: a verdict's structured data (its fixes as spec changes, its cost in time)

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-26
"""
import sqlalchemy as sa
from alembic import op

revision = '0014'
# 0013 (attempt columns) lands in parallel; on this branch the chain goes through 0012 until merge
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'job_changes',
        sa.Column('id', sa.Integer(), primary_key=True),
        sa.Column('job_id', sa.Integer(), sa.ForeignKey('jobs.id'), nullable=False),
        sa.Column('kind', sa.String(32), nullable=False),
        sa.Column('state', sa.String(16), nullable=False),
        sa.Column('alert_id', sa.Integer(), nullable=True),
        sa.Column('reverts', sa.Integer(), nullable=True),
        sa.Column('changes', sa.Text(), nullable=False),
        sa.Column('fix', sa.Text(), nullable=False),
        sa.Column('resume', sa.String(16), nullable=False),
        sa.Column('by_token_id', sa.Integer(), nullable=True),
        sa.Column('created_at', sa.Float(), nullable=False),
        sa.Column('applied_at', sa.Float(), nullable=True),
        sa.Column('from_attempt', sa.Integer(), nullable=True),
        sa.Column('to_attempt', sa.Integer(), nullable=True),
        sa.Column('resume_step', sa.Integer(), nullable=True),
        sa.Column('before', sa.Text(), nullable=True),
        sa.Column('verdict', sa.Text(), nullable=True),
    )
    op.create_index('ix_job_changes_job_id', 'job_changes', ['job_id'])
    with op.batch_alter_table('alerts') as b:
        b.add_column(sa.Column('data', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('alerts') as b:
        b.drop_column('data')
    op.drop_index('ix_job_changes_job_id', 'job_changes')
    op.drop_table('job_changes')
