"""Editing a sent message and regenerating the last reply: the stored chat is cut back to
just before the message (as the OpenAI API cuts a chat a client edited), then the turn runs
as usual. Within the context window the turn's `context_len` cuts the engine's copy back to
the same point; a cut that removes the message that opened the window frees it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from app.turns.deps import TurnDeps
from app.turns.pipeline import Sink
from app.turns.request import TurnRequest


async def _cut_back(
    deps: TurnDeps, conversation_id: str, keep: int, system_prompt: str | None
) -> None:
    """Keep the first `keep` stored messages."""
    if await deps.store.rewind(conversation_id, keep, system_prompt):
        await deps.engine.free(conversation_id)


def edit(
    deps: TurnDeps, conversation_id: str, seq: int, sink: Sink
) -> Callable[[], Awaitable[bool]]:
    """A `before_turn` that cuts the chat back to before the user's message `seq`; False
    (with an error sent) when there is no such message of the user."""

    async def before() -> bool:
        conv = await deps.store.get_conversation(conversation_id)
        if conv is None:
            return True  # the turn answers not_found
        history = await deps.store.messages(conversation_id)
        target = next((m for m in history if m.seq == seq), None)
        if target is None:
            await sink.error("unknown_seq", f"this chat has no message {seq}", seq=seq)
            return False
        if target.role != "user":
            await sink.error(
                "bad_seq", f"message {seq} is a reply; only your own messages can be edited"
            )
            return False
        await _cut_back(deps, conversation_id, seq, conv.system_prompt)
        return True

    return before


def regenerate(
    deps: TurnDeps, conversation_id: str, req: TurnRequest, sink: Sink
) -> Callable[[], Awaitable[bool]]:
    """A `before_turn` that cuts the chat back to before its last user message and asks it
    again (`req.content` becomes that message); False when the chat has none."""

    async def before() -> bool:
        conv = await deps.store.get_conversation(conversation_id)
        if conv is None:
            return True
        history = await deps.store.messages(conversation_id)
        last = next((m for m in reversed(history) if m.role == "user"), None)
        if last is None:
            await sink.error("nothing_to_regenerate", "this chat has no message to answer again")
            return False
        req.content = last.content
        await _cut_back(deps, conversation_id, last.seq, conv.system_prompt)
        return True

    return before
