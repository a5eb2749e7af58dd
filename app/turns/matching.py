"""Hashes of a chat's prefixes, so that a request that resends the whole chat (the OpenAI
API) finds the conversation it continues by an index lookup, not a scan.

The hash after message i covers the system prompt and messages 0..i (role and text, in an
unambiguous JSON encoding). Stored replies keep theirs in `messages.prefix_hash`."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable


def start(system_prompt: str | None) -> str:
    return _digest("", "system", system_prompt or "")


def extend(prev: str, role: str, content: str) -> str:
    return _digest(prev, role, content)


def chain(system_prompt: str | None, messages: Iterable[tuple[str, str]]) -> list[str]:
    """The hash after each message."""
    h, out = start(system_prompt), []
    for role, content in messages:
        h = extend(h, role, content)
        out.append(h)
    return out


def _digest(prev: str, role: str, content: str) -> str:
    data = json.dumps([prev, role, content], ensure_ascii=False).encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()


def common_turns(
    stored_system: str | None,
    stored: list[tuple[str, str]],
    system: str | None,
    messages: list[tuple[str, str]],
) -> int:
    """How many stored messages a request continues from: the longest common prefix of
    whole turns (ending with a reply), leaving the request at least its last message."""
    if (stored_system or None) != (system or None):
        return 0
    keep = 0
    for i, (a, b) in enumerate(zip(stored, messages[:-1], strict=False)):
        if a != b:
            break
        if a[0] == "assistant":
            keep = i + 1
    return keep


async def find_conversation(
    store, owner_id: str, system: str | None, messages: list[tuple[str, str]]
) -> str | None:
    """The owner's conversation with the longest stored prefix of `messages`, cut at a reply:
    one indexed lookup of the request's prefix hashes. Among equals, one that ends there
    (a plain continuation) wins over one the request would cut back, then the latest."""
    hashes = chain(system, messages)
    at = {h: i for i, h in enumerate(hashes[:-1]) if messages[i][0] == "assistant"}
    matches = [
        m for m in await store.find_prefixes(owner_id, list(at)) if at[m.prefix_hash] == m.seq
    ]
    if not matches:
        return None
    best = max(matches, key=lambda m: (m.seq, m.last_seq == m.seq, m.updated))
    return best.conversation_id
