"""Responses of the OpenAI Responses API: each names the reply it produced."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import delete, select

from store.base import StorePart
from store.models import ApiResponse, Message


class Responses(StorePart):
    """Stored responses, scoped to their owner."""

    async def add_response(
        self, response: ApiResponse, reply_item_id: str | None, input_item_ids: Sequence[str]
    ) -> None:
        """Store a response; its reply and the input messages stored just before it take
        the item ids the API gave them, in the same transaction."""
        async with self.sessions.begin() as s:
            s.add(response)
            reply = await s.get(Message, response.message_id) if response.message_id else None
            if reply is None:
                return
            reply.item_id = reply_item_id
            n = len(input_item_ids)
            rows = list(
                await s.scalars(
                    select(Message)
                    .where(
                        Message.conversation_id == reply.conversation_id,
                        Message.seq < reply.seq,
                        Message.seq >= reply.seq - n,
                    )
                    .order_by(Message.seq)
                )
            )
            for m, item_id in zip(rows, input_item_ids[n - len(rows) :], strict=True):
                m.item_id = item_id

    async def get_response(self, response_id: str, owner_id: str) -> ApiResponse | None:
        q = select(ApiResponse).where(
            ApiResponse.id == response_id, ApiResponse.owner_id == owner_id
        )
        async with self.sessions() as s:
            return await s.scalar(q)

    async def delete_response(self, response_id: str, owner_id: str) -> bool:
        q = delete(ApiResponse).where(
            ApiResponse.id == response_id, ApiResponse.owner_id == owner_id
        )
        async with self.sessions.begin() as s:
            return (await s.execute(q)).rowcount > 0
