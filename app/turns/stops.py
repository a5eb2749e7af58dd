"""Stop strings matched on the reply's text as it streams: text is passed on only once no
stop string can begin in it, and the reply ends before the first match."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        # A match can begin in the last len(longest) - 1 characters: hold those back.
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # the reply so far (cut before the match once one is found)
        self.sent = 0  # characters of text already passed on
        self.hit = False

    def push(self, piece: str) -> str:
        """Add the next piece of text; return what may be passed on now."""
        if self.hit:
            return ""
        self.text += piece
        # A match cannot begin in text already sent: that was checked with its hold.
        found = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if found:
            self.hit = True
            self.text = self.text[: min(found)]
            return self._take(len(self.text))
        return self._take(len(self.text) - self.hold)

    def flush(self) -> str:
        """The reply ended without a match: the rest of the text."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out
