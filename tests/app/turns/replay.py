"""A chat replayed as the pipeline runs its turns (plan, cut, reply, re-encode), with
replies given as (text, token ids): what the re-encode tests of each template share."""

from __future__ import annotations

from app.turns.reencode import reencode
from app.turns.window import plan_turn


class Msg:
    def __init__(self, role: str, content: str, token_ids: list[int]) -> None:
        self.role, self.content, self.token_ids = role, content, token_ids
        self.starts_context = False


def _cut(history: list[Msg], keep: int) -> None:
    for m in history:
        m.token_ids, keep = m.token_ids[:keep], max(0, keep - len(m.token_ids))


def chat(
    tok, replies: list[tuple[str, list[int]]], stop: set[int], redo: bool
) -> list[tuple[int, int]]:
    """Per turn: (context kept, stream before it). `redo`: each reply re-encoded."""
    history: list[Msg] = []
    kept = []
    for i, (text, ids) in enumerate(replies):
        plan = plan_turn(tok, "Be brief.", history, f"question {i}", 4096, 64, True)
        stored = sum(len(m.token_ids) for m in history)
        kept.append((plan.context_len, stored))
        if plan.context_len < stored:  # the pipeline's cut (store.truncate)
            _cut(history, plan.context_len)
        history.append(Msg("user", f"question {i}", plan.prompt))
        r = reencode(tok, plan.messages, plan.stream, plan.context_len, text, ids, stop)
        if redo and r is not None:
            _cut(history, r.keep)
            ids = r.token_ids
        history.append(Msg("assistant", text, ids))
    return kept
