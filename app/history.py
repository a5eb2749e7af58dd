"""Stored-stream surgery the chat needs when a chat template is not prefix-stable."""

from __future__ import annotations

from sqlalchemy import select

from store.models import Message


async def truncate_stream(store, conversation_id: str, length: int) -> None:
    """Cut the conversation's stored token stream to its first `length` tokens.

    Messages keep their text; the tokens past the cut are dropped, so the stream stays
    exactly what the engine holds (it recomputes from `length` with the re-rendered turn)."""
    async with store.sessions.begin() as s:
        rows = await s.scalars(
            select(Message)
            .where(
                Message.conversation_id == conversation_id,
                Message.token_start + Message.token_count > length,
            )
            .order_by(Message.seq)
        )
        for m in rows:
            keep = max(0, length - m.token_start)
            m.token_ids = list(m.token_ids[:keep])
            m.token_start = min(m.token_start, length)
            m.token_count = keep
