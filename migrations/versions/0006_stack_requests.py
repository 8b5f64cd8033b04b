"""jobs.stack_requested_at: a stack request is a look, kept apart from requested_action (cancel or
pause), so it can never overwrite a cancel

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""
import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as b:
        b.add_column(sa.Column('stack_requested_at', sa.Float(), nullable=True))
    # a stack request pending at upgrade time moves to its own column
    op.execute("UPDATE jobs SET stack_requested_at = 0, requested_action = NULL WHERE requested_action = 'stack'")


def downgrade() -> None:
    with op.batch_alter_table('jobs') as b:
        b.drop_column('stack_requested_at')
