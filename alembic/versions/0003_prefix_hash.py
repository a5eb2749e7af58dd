"""messages.prefix_hash and conversations.session_key: find the conversation an OpenAI-style
request (which resends the whole chat) continues, by index lookups.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.add_column(sa.Column("prefix_hash", sa.String(64), nullable=True))
        batch.create_index("ix_messages_prefix_hash", ["prefix_hash"])
    with op.batch_alter_table("conversations") as batch:
        batch.add_column(sa.Column("session_key", sa.String(200), nullable=True))
        batch.create_index("ix_conversations_owner_id_session_key", ["owner_id", "session_key"])


def downgrade() -> None:
    with op.batch_alter_table("conversations") as batch:
        batch.drop_index("ix_conversations_owner_id_session_key")
        batch.drop_column("session_key")
    with op.batch_alter_table("messages") as batch:
        batch.drop_index("ix_messages_prefix_hash")
        batch.drop_column("prefix_hash")
