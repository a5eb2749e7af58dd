"""responses: the OpenAI Responses API's stored responses, each naming a point of a
conversation (the reply it produced); conversations.api_metadata and messages.item_id for
the Conversations API.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("conversations") as batch:
        batch.add_column(sa.Column("api_metadata", sa.JSON(), nullable=True))
    with op.batch_alter_table("messages") as batch:
        batch.add_column(sa.Column("item_id", sa.String(40), nullable=True))
    op.create_table(
        "responses",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("owner_id", sa.String(32), nullable=False),
        sa.Column("conversation_id", sa.String(32), nullable=False),
        sa.Column("message_id", sa.Integer(), nullable=True),
        sa.Column("previous_response_id", sa.String(40), nullable=True),
        sa.Column("created", sa.DateTime(timezone=True), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_responses")),
        sa.ForeignKeyConstraint(
            ["owner_id"], ["users.id"], name=op.f("fk_responses_owner_id_users"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["conversation_id"],
            ["conversations.id"],
            name=op.f("fk_responses_conversation_id_conversations"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["message_id"],
            ["messages.id"],
            name=op.f("fk_responses_message_id_messages"),
            ondelete="SET NULL",
        ),
    )
    op.create_index(op.f("ix_responses_conversation_id"), "responses", ["conversation_id"])
    op.create_index(op.f("ix_responses_message_id"), "responses", ["message_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_responses_message_id"), table_name="responses")
    op.drop_index(op.f("ix_responses_conversation_id"), table_name="responses")
    op.drop_table("responses")
    with op.batch_alter_table("messages") as batch:
        batch.drop_column("item_id")
    with op.batch_alter_table("conversations") as batch:
        batch.drop_column("api_metadata")
