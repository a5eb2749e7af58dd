"""Chat template rendering for one new turn: the token ids that extend the stored stream."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Delta:
    token_ids: list[int]  # what the engine computes for this turn's prompt
    context_len: int  # tokens of the stored stream kept before them


def chat_messages(
    system_prompt: str | None, history: list[tuple[str, str]], user: str
) -> list[dict]:
    """The template's input: optional system prompt, earlier turns, the new user message."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages += [{"role": role, "content": content} for role, content in history]
    return messages + [{"role": "user", "content": user}]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def render_delta(tokenizer, messages: list[dict], stored: list[int]) -> Delta:
    """Render the whole chat, keep what the stored stream already holds, tokenize the rest.

    The stored stream is what the model saw, so it is never re-tokenized. When the template
    is prefix-stable (the usual case) the new text simply follows it. Otherwise the longest
    common token prefix is kept and everything after it is recomputed."""
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    seen = tokenizer.decode(stored, skip_special_tokens=False)
    if full.startswith(seen):
        ids = tokenizer(full[len(seen) :], add_special_tokens=False).input_ids
        if ids:
            return Delta(list(ids), len(stored))
    full_ids = list(tokenizer(full, add_special_tokens=False).input_ids)
    keep = common_prefix(full_ids, stored)
    if keep == len(full_ids):  # the new prompt must compute at least one token
        keep -= 1
    return Delta(full_ids[keep:], keep)
