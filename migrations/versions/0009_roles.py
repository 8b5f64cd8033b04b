"""Roles that hold: tokens.created_by (who minted it: a user sees and revokes only its own),
jobs.owner_token_id (who submitted it: only they or an admin may control it; NULL = from before
owners existed, treated as the admin's), jobs.report_hash (an external job's own credential).

Existing tokens keep working: the first live user token (lowest id) becomes `admin` (said on
stderr and in the log), and live agent tokens get the `commands` and `gang` rights they had in effect
before (any agent could opt into command jobs and gangs); revoke the ones you do not recognize.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24
"""
import logging
import sys

import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('tokens') as b:
        b.add_column(sa.Column('created_by', sa.Integer(), nullable=True))
    with op.batch_alter_table('jobs') as b:
        b.add_column(sa.Column('owner_token_id', sa.Integer(), nullable=True))
        b.add_column(sa.Column('report_hash', sa.String(length=64), nullable=True))
        b.create_index('ix_jobs_owner_token_id', ['owner_token_id'])
    conn = op.get_bind()
    first = conn.execute(sa.text("SELECT id, name FROM tokens WHERE role = 'user' AND revoked_at IS NULL "
                                 "ORDER BY id LIMIT 1")).first()
    if first is not None:
        conn.execute(sa.text("UPDATE tokens SET role = 'admin' WHERE id = :id"), {"id": first.id})
        _say(f"tokenpulse upgrade: token {first.id} ({first.name!r}), the first user token, is now the admin "
             "token (only admins list, mint and revoke others' tokens); other user tokens are plain users")
    agents = conn.execute(sa.text("SELECT id FROM tokens WHERE role = 'agent' AND revoked_at IS NULL")).all()
    if agents:
        conn.execute(sa.text("UPDATE tokens SET scopes = 'commands gang' WHERE role = 'agent' AND revoked_at IS NULL"))
        _say(f"tokenpulse upgrade: agent tokens {', '.join(str(a.id) for a in agents)} keep taking command "
             "and multi-node jobs (rights 'commands gang'); revoke any you do not recognize "
             "(`tokenpulse tokens list`)")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    logging.getLogger("tokenpulse").warning(line)


def downgrade() -> None:
    conn = op.get_bind()
    conn.execute(sa.text("UPDATE tokens SET role = 'user' WHERE role = 'admin'"))
    conn.execute(sa.text("UPDATE tokens SET revoked_at = created_at WHERE role = 'metrics' AND revoked_at IS NULL"))
    conn.execute(sa.text("UPDATE tokens SET role = 'user', scopes = '' WHERE role = 'metrics'"))
    conn.execute(sa.text("UPDATE tokens SET scopes = '' WHERE role = 'agent'"))
    with op.batch_alter_table('jobs') as b:
        b.drop_index('ix_jobs_owner_token_id')
        b.drop_column('report_hash')
        b.drop_column('owner_token_id')
    with op.batch_alter_table('tokens') as b:
        b.drop_column('created_by')
