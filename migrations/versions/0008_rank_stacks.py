"""job_ranks.stack: a rank's stacks as its agent read them, for node rank 0's agent to merge every
node's ranks into one verdict; gang_members.stack_requested_at: node rank 0's agent asked the other
nodes for them (one-shot)

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23
"""
import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('job_ranks') as batch_op:
        batch_op.add_column(sa.Column('stack', sa.Text(), nullable=True))
    with op.batch_alter_table('gang_members') as batch_op:
        batch_op.add_column(sa.Column('stack_requested_at', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('gang_members') as batch_op:
        batch_op.drop_column('stack_requested_at')
    with op.batch_alter_table('job_ranks') as batch_op:
        batch_op.drop_column('stack')
