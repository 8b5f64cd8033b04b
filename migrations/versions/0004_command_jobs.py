"""command jobs: jobs.kind (train or command); agents.accepts_commands (started with
--allow-commands); tokens.scopes ("commands": may submit command jobs). The user token made at
first start keeps working as before on one machine: it gets the commands scope.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""
import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as b:
        b.add_column(sa.Column('kind', sa.String(length=16), nullable=False, server_default='train'))
    with op.batch_alter_table('agents') as b:
        b.add_column(sa.Column('accepts_commands', sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table('tokens') as b:
        b.add_column(sa.Column('scopes', sa.String(length=200), nullable=False, server_default=''))
    # server.auth.ensure_initial_tokens names it so (self-contained: a migration must not change with code)
    op.execute("UPDATE tokens SET scopes = 'commands' WHERE role = 'user' AND name = 'initial user' "
               "AND revoked_at IS NULL")


def downgrade() -> None:
    with op.batch_alter_table('tokens') as b:
        b.drop_column('scopes')
    with op.batch_alter_table('agents') as b:
        b.drop_column('accepts_commands')
    with op.batch_alter_table('jobs') as b:
        b.drop_column('kind')
