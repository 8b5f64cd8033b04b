"""agents.instance: a stable id of an agent's work dir on its host, so a restarted agent keeps its
identity (the workers list no longer grows by one dead row per restart)

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25
"""
import sqlalchemy as sa
from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('agents') as b:
        b.add_column(sa.Column('instance', sa.String(64), nullable=True))
        b.create_index('ix_agents_instance', ['instance'])


def downgrade() -> None:
    with op.batch_alter_table('agents') as b:
        b.drop_index('ix_agents_instance')
        b.drop_column('instance')
