"""The prompt a /v1 chat request's turn would give its engine, planned as the turn plans it
but without running it or writing anything: what vLLM's render endpoints answer
(app/openai/tokens.py), and what a KV-aware router matches against the engines' caches.

A request bound to a stored conversation (its session, else the stored chat it extends:
app/openai/chat.py) extends that conversation's token stream, cut back where the request
edited the chat, exactly as its turn would (`ChatTurn`'s aligner and `_prepare`); one bound
to none renders as a new chat's first turn."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from app.openai.chat import Chat
from app.services import Services
from app.turns import matching, toolcalls
from app.turns.window import Plan, plan_turn
from engine.types import SamplingParams


@dataclass
class Closed:
    """The empty reply a turn stores ahead of its own when the previous turn's reply never
    was (see `ChatTurn._prepare`)."""

    role: str = "assistant"
    content: str = ""
    token_ids: list[int] = field(default_factory=list)
    starts_context: bool = False


async def plan_for(
    sv: Services,
    cid: str | None,
    chat: Chat,
    sampling: SamplingParams,
    given: bool,
    tools: list[dict] | None,
) -> Plan:
    """The turn's plan: `plan.stream` is the engine's tokens through its prompt (what the
    usage counts as prompt tokens); NoRoom where even a fresh window cannot hold it."""
    system, history, before = chat.system, [], chat.messages[:-1]
    conv = None if cid is None else await sv.store.get_conversation(cid)
    if conv is not None:
        stored = await sv.store.messages(cid)
        pairs = [(m.role, toolcalls.as_sent(m.role, m.content)) for m in stored]
        keep = matching.common_turns(conv.system_prompt, pairs, chat.system, chat.messages)
        if keep == len(stored) and (conv.system_prompt or None) == chat.system:
            system = conv.system_prompt  # not edited: nothing cut back
        history, before = stored[:keep], chat.messages[keep:-1]
        if history and history[-1].role in ("user", "tool") and history[-1].token_ids:
            history = [*history, Closed()]
    role, content = chat.messages[-1]
    engine = sv.engine
    return await asyncio.to_thread(
        plan_turn,
        engine.tokenizer,
        system,
        history,
        content,
        engine.context_limit,
        sampling.max_tokens,
        given,
        before,
        role,
        tools,
    )
