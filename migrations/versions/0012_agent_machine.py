"""agents.machine: the agent's machine summary (CPU, memory, network, GPUs), its latest sample, so every
server process on a database shows it on the workers page (it was kept in one process's memory)

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25
"""
import sqlalchemy as sa
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('agents') as b:
        b.add_column(sa.Column('machine', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('agents') as b:
        b.drop_column('machine')
