"""browser sessions: the login cookie carries a session secret (hashed here), revocable at logout and
expiring, instead of the raw API token

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""
import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'sessions',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('hash', sa.String(64), nullable=False),
        sa.Column('token_id', sa.Integer(), sa.ForeignKey('tokens.id'), nullable=False),
        sa.Column('created_at', sa.Float(), nullable=False),
        sa.Column('expires_at', sa.Float(), nullable=False),
        sa.Column('revoked_at', sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('hash'),
    )


def downgrade() -> None:
    op.drop_table('sessions')
