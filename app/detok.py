"""Incremental detokenization: text pieces as tokens arrive, never half a character."""

from __future__ import annotations


class Detokenizer:
    """Emits the text a new token adds. Text ending in U+FFFD is held back until the bytes of
    a character split across tokens are complete (the offsets scheme vLLM uses)."""

    def __init__(self, tokenizer, skip_ids: set[int] = frozenset()) -> None:
        self._tok = tokenizer
        self._skip = skip_ids
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens already emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        if token_id in self._skip:
            return ""
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character shows as U+FFFD)."""
        before = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return text[len(before) :]

    def text(self) -> str:
        return self._decode(self.ids)
