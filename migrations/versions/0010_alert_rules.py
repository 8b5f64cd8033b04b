"""Alert rules people write (issue 22, item 2): a scope (all jobs, a name glob, one job), a
condition on a metric or a job state, a severity and its webhook channels; owned by the token
that made it (its principal).

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25
"""
import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'alert_rules',
        sa.Column('id', sa.Integer(), primary_key=True),
        sa.Column('name', sa.String(length=200), nullable=False),
        sa.Column('owner_token_id', sa.Integer(), nullable=True, index=True),
        sa.Column('scope', sa.String(length=8), nullable=False),  # all, name, job
        sa.Column('pattern', sa.String(length=200), nullable=True),  # the name glob
        sa.Column('job_id', sa.Integer(), nullable=True),
        sa.Column('condition', sa.String(length=16), nullable=False),
        sa.Column('metric', sa.String(length=64), nullable=True),
        sa.Column('threshold', sa.Float(), nullable=True),
        sa.Column('steps', sa.Integer(), nullable=True),
        sa.Column('sigmas', sa.Float(), nullable=True),
        sa.Column('mode', sa.String(length=4), nullable=True),  # min / max: what "improvement" means
        sa.Column('state', sa.String(length=16), nullable=True),
        sa.Column('severity', sa.String(length=16), nullable=False),
        sa.Column('channels', sa.Text(), nullable=False),  # JSON list of {url, format}
        sa.Column('created_at', sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table('alert_rules')
