"""Incremental detokenization: text pieces as tokens arrive, never half a character."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from app.turns.harmony import FINAL, Channels


class Detokenizer:
    """The tokenizers library's DecodeStream (it holds back the bytes of a character split
    across tokens), plus the reply's ids for its whole text and a final flush. `channels`: a
    harmony reply (app/turns/harmony.py), of which only the final channel is text."""

    def __init__(
        self, tokenizer, skip_ids: set[int] = frozenset(), channels: Channels | None = None
    ) -> None:
        self._tok = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self._skip = skip_ids
        self._channels = channels
        self._stream = DecodeStream(skip_special_tokens=True)
        self._emitted = 0  # characters of text() already handed out
        self.ids: list[int] = []

    def push(self, token_id: int) -> str:
        if token_id in self._skip:
            return ""
        if self._channels is not None and self._channels.route(token_id) != FINAL:
            return ""
        self.ids.append(token_id)
        piece = self._stream.step(self._backend, token_id) or ""
        self._emitted += len(piece)
        return piece

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character shows as U+FFFD)."""
        if self._channels is not None and not self._channels.opened:
            self.ids += self._channels.header()  # no message opened: the text as written
            self._channels = None
        tail = self.text()[self._emitted :]
        self._emitted += len(tail)
        return tail

    def text(self) -> str:
        return self._tok.decode(self.ids, skip_special_tokens=True)
