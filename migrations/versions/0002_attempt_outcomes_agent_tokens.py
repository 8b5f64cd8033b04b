"""attempts: why each ended (failure kind, exit code, signal) and where it resumed from;
agents: the token that registered them (an agent token can act only for its own agents)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""
import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('attempts') as b:
        b.add_column(sa.Column('failure', sa.String(length=32), nullable=True))
        b.add_column(sa.Column('exit_code', sa.Integer(), nullable=True))
        b.add_column(sa.Column('signal', sa.String(length=32), nullable=True))
        b.add_column(sa.Column('resumed_from', sa.Text(), nullable=True))
    with op.batch_alter_table('agents') as b:
        b.add_column(sa.Column('token_id', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('agents') as b:
        b.drop_column('token_id')
    with op.batch_alter_table('attempts') as b:
        b.drop_column('resumed_from')
        b.drop_column('signal')
        b.drop_column('exit_code')
        b.drop_column('failure')
