"""Stop strings over streamed text: text that might begin a stop string is held back until it
cannot, so a stop string split across two tokens never leaks into the output.

With ``include`` (vLLM's ``include_stop_str_in_output``) the answer keeps the stop string that ended
it, so nothing needs holding back: text leaves as it comes, and the stop string leaves with it.
"""

from __future__ import annotations

__all__ = ["StopChecker"]


class StopChecker:
    def __init__(self, stops: tuple[str, ...], *, include: bool = False) -> None:
        self.stops = stops
        self.include = include
        # a stop string ending in new text may begin this many characters before it
        self._reach = max((len(s) for s in stops), default=1) - 1
        self._hold = 0 if include else self._reach
        self._text = ""  # the text a stop string may still begin in: emitted, then held
        self._num_emitted = 0  # how much of ``_text`` has left already
        self.hit = False

    def feed(self, delta: str, *, can_stop: bool = True) -> str:
        """The part of ``delta`` (plus held text) that is safe to emit now; ``can_stop`` False: a stop
        string that ends in ``delta`` does not count (vLLM's ``min_tokens``), and is never found later."""
        if self.hit:
            return ""
        if not self.stops:
            return delta
        start = len(self._text)
        self._text += delta
        if can_stop and delta:
            found = [(i, s) for s in self.stops if (i := self._text.find(s, max(0, start - len(s) + 1))) >= 0]
            if found:
                index, stop = min(found)
                self.hit = True
                return self._text[self._num_emitted : index + len(stop) if self.include else index]
        cut = max(len(self._text) - self._hold, self._num_emitted)
        out = self._text[self._num_emitted : cut]
        # keep only the emitted text a later stop string may begin in
        drop = max(0, cut - self._reach)
        self._text, self._num_emitted = self._text[drop:], cut - drop
        return out

    def flush(self, delta: str = "", *, can_stop: bool = True) -> str:
        """At the end of the sequence: everything still held (unless a stop string was hit)."""
        out = self.feed(delta, can_stop=can_stop)
        if self.hit:
            return out
        out, self._num_emitted = out + self._text[self._num_emitted :], len(self._text)
        return out
