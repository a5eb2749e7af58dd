"""retention: what a conversation's retention held in the engine when its last turn ended
(a pin in memory until a wall time, counted against its owner's cap; a priority; a finished
session), so that a restart or a deploy puts it back.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "retention",
        sa.Column("conversation_id", sa.String(32), nullable=False),
        sa.Column("owner_id", sa.String(32), nullable=False),
        sa.Column("replica", sa.String(200), nullable=True),
        sa.Column("ttl_s", sa.Float(), nullable=True),
        sa.Column("pinned_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("pinned_bytes", sa.BigInteger(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("done", sa.Boolean(), nullable=False),
        sa.Column("updated", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("conversation_id", name=op.f("pk_retention")),
        sa.ForeignKeyConstraint(
            ["conversation_id"],
            ["conversations.id"],
            name=op.f("fk_retention_conversation_id_conversations"),
            ondelete="CASCADE",
        ),
    )


def downgrade() -> None:
    op.drop_table("retention")
