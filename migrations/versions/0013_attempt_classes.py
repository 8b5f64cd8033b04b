"""attempts: the retry policy's account of each attempt: the failure's class, the change made for the
next attempt (JSON), why the next was (not) made, a hang's step and frame, the peak memory reached and
the seconds from a checkpoint request (pause, stop, SIGTERM from outside) to its saved checkpoint

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26
"""
import sqlalchemy as sa
from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('attempts') as b:
        b.add_column(sa.Column('failure_class', sa.String(32), nullable=True))
        b.add_column(sa.Column('change', sa.Text(), nullable=True))
        b.add_column(sa.Column('decision', sa.Text(), nullable=True))
        b.add_column(sa.Column('hang_step', sa.Integer(), nullable=True))
        b.add_column(sa.Column('hang_frame', sa.Text(), nullable=True))
        b.add_column(sa.Column('peak_mb', sa.Float(), nullable=True))
        b.add_column(sa.Column('checkpoint_s', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('attempts') as b:
        for name in ('checkpoint_s', 'peak_mb', 'hang_frame', 'hang_step', 'decision', 'change', 'failure_class'):
            b.drop_column(name)
