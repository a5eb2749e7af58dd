"""Which conversation a Dynamo request continues.

Dynamo's frontend sends the whole templated prompt every turn, with no conversation id. The
engine holds each conversation's token stream (prompts and replies, the stop token
included); a returning turn's prompt starts with its conversation's stream. So each stream's
full chunks are indexed by their chain hash (the one the engine and its KV events use), and
a prompt finds the conversation of its deepest known chunk, then the exact common length."""

from __future__ import annotations

from dataclasses import dataclass

from engine.cache.sharing import chain_hashes


@dataclass(frozen=True)
class Match:
    conversation_id: str
    common: int  # tokens the prompt and the stream share from position 0
    length: int  # the stream's length


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Streams:
    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self.tokens: dict[str, list[int]] = {}
        self.keys: dict[str, list[bytes]] = {}
        self.by_key: dict[bytes, set[str]] = {}

    def match(self, prompt: list[int]) -> Match | None:
        """The conversation sharing the longest prefix with `prompt` (None: no full chunk
        in common with any)."""
        keys = chain_hashes(prompt, self.chunk_size)
        for key in reversed(keys):  # the deepest known chunk first
            held = self.by_key.get(key)
            if held:
                best = max(held, key=lambda c: common_prefix(self.tokens[c], prompt))
                stream = self.tokens[best]
                return Match(best, common_prefix(stream, prompt), len(stream))
        return None

    def put(self, conversation_id: str, tokens: list[int]) -> None:
        """The conversation's stream is now `tokens`."""
        self.forget(conversation_id)
        keys = chain_hashes(tokens, self.chunk_size)
        self.tokens[conversation_id], self.keys[conversation_id] = tokens, keys
        for key in keys:
            self.by_key.setdefault(key, set()).add(conversation_id)

    def forget(self, conversation_id: str) -> None:
        self.tokens.pop(conversation_id, None)
        for key in self.keys.pop(conversation_id, []):
            held = self.by_key.get(key)
            if held is not None:
                held.discard(conversation_id)
                if not held:
                    del self.by_key[key]
