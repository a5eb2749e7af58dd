"""SQL schema of conversations, their messages and their owners, the Responses API's
responses, and the retention a conversation's client asked for (kept across restarts)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

ROLES = ("system", "user", "assistant", "tool")

# Named constraints, so that later migrations (and SQLite batch mode) can address them.
NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC timestamps on every backend (SQLite returns naive ones)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime given; use an aware UTC datetime")
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {datetime: UTCDateTime()}


class User(Base):
    __tablename__ = "users"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    # sha256 hex of the bearer token; the token itself is never stored.
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created: Mapped[datetime] = mapped_column(default=utcnow)


class Conversation(Base):
    __tablename__ = "conversations"
    __table_args__ = (
        Index(None, "owner_id", "updated"),
        Index(None, "owner_id", "session_key"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    owner_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    title: Mapped[str] = mapped_column(String(200), default="")
    system_prompt: Mapped[str | None] = mapped_column(Text)
    created: Mapped[datetime] = mapped_column(default=utcnow)
    updated: Mapped[datetime] = mapped_column(default=utcnow)
    # The name an API client gave the chat (X-Session-ID / prompt_cache_key), if any.
    session_key: Mapped[str | None] = mapped_column(String(200))
    # The Conversations API's metadata (up to 16 string pairs), if the chat was made there.
    api_metadata: Mapped[dict | None] = mapped_column(JSON)


class Message(Base):
    __tablename__ = "messages"
    __table_args__ = (
        UniqueConstraint("conversation_id", "seq"),
        Index(None, "conversation_id", "token_start"),
        CheckConstraint("role IN ('system', 'user', 'assistant', 'tool')", name="role"),
        CheckConstraint("seq >= 0 AND token_start >= 0 AND token_count >= 0", name="positions"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    conversation_id: Mapped[str] = mapped_column(ForeignKey("conversations.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[str] = mapped_column(Text)
    # The exact token ids the model saw for this message (JSON list of ints).
    token_ids: Mapped[list[int]] = mapped_column(JSON)
    # Position of this message's first token in its context window's token stream.
    token_start: Mapped[int] = mapped_column(Integer)
    # len(token_ids), kept as a column so range reads can select overlapping rows in SQL.
    token_count: Mapped[int] = mapped_column(Integer)
    created: Mapped[datetime] = mapped_column(default=utcnow)
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    # This message opens a new context window: its token ids render the system prompt, the
    # latest earlier turns that fit and itself, and start at position 0. The model's stream
    # is the messages from the last such one on (or from the first message).
    starts_context: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())

    # On a reply: hash of the system prompt and every message up to this one (app/turns/matching.py),
    # so that a request resending the whole chat finds where it continues by an index lookup.
    prefix_hash: Mapped[str | None] = mapped_column(String(64), index=True)
    # The id the Responses / Conversations API gave this message as an item ("msg_..."),
    # when it gave one before the row existed; else the item id is made of `id`.
    item_id: Mapped[str | None] = mapped_column(String(40))

    @property
    def token_end(self) -> int:
        return self.token_start + self.token_count


class ApiResponse(Base):
    """A response of the OpenAI Responses API: the reply it produced names its point in its
    conversation (`message_id`), from which a later response goes on or forks."""

    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    owner_id: Mapped[str] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    conversation_id: Mapped[str] = mapped_column(
        ForeignKey("conversations.id", ondelete="CASCADE"), index=True
    )
    # The reply; None once an edit of the conversation removed it.
    message_id: Mapped[int | None] = mapped_column(
        ForeignKey("messages.id", ondelete="SET NULL"), index=True
    )
    previous_response_id: Mapped[str | None] = mapped_column(String(40))
    created: Mapped[datetime] = mapped_column(default=utcnow)
    body: Mapped[dict] = mapped_column(JSON)  # the response object as answered
    input_items: Mapped[list] = mapped_column(JSON)  # the items that went in


class ConversationRetention(Base):
    """What a conversation's retention held in the engine when its last turn ended (a pin
    in memory until `pinned_until`, a priority, a finished session), put back into the
    engine when the server starts again (app/turns/retention.py)."""

    __tablename__ = "retention"

    conversation_id: Mapped[str] = mapped_column(
        ForeignKey("conversations.id", ondelete="CASCADE"), primary_key=True
    )
    owner_id: Mapped[str] = mapped_column(String(32))  # whose cap of pinned bytes it counts on
    # The replica whose engine holds it (--cluster; None for a lone server): each puts back
    # its own, so that an owner's pins count once.
    replica: Mapped[str | None] = mapped_column(String(200))
    ttl_s: Mapped[float | None] = mapped_column(Float)  # None: no pin, a priority alone
    pinned_until: Mapped[datetime | None] = mapped_column()
    pinned_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    priority: Mapped[int] = mapped_column(Integer, default=50)
    done: Mapped[bool] = mapped_column(Boolean, default=False)  # ttl_s 0: its chunks go first
    updated: Mapped[datetime] = mapped_column(default=utcnow)
