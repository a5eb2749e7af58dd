"""messages.role may be 'tool': a function's result, sent back by the client (tool calls).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _roles(roles: str) -> None:
    with op.batch_alter_table("messages") as batch:
        batch.drop_constraint("role", type_="check")
        batch.create_check_constraint("role", f"role IN ({roles})")


def upgrade() -> None:
    _roles("'system', 'user', 'assistant', 'tool'")


def downgrade() -> None:
    op.execute("DELETE FROM messages WHERE role = 'tool'")
    _roles("'system', 'user', 'assistant'")
