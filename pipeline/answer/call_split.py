"""CallSplit: where an answer's tool calls begin, read from its text as it streams.

Used when the grammar spans the whole answer (``ToolPlan.spans_answer``): no marker token tells
where the calls open, so the text does. With a marker (Hermes' ``<tool_call>``, written in several
tokens) the calls open where its text first appears; the end of the text that could still grow
into the marker is held back until the next chunk says whether it does, so no part of the marker
leaks into the content. Without one (Llama 3's JSON) the answer is one call when it opens with
``{``, as its grammar allows only then, and text otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CallSplit"]


@dataclass
class CallSplit:
    """One choice's split of its text into content and call text; ``marker``: the calls' opening
    text, empty where a call is the whole answer."""

    marker: str = ""
    is_open: bool = False  # the calls have begun: everything from here on is call text
    _held: str = ""  # the content's end, a proper prefix of the marker
    _is_text: bool = False  # no marker: the answer opened as text

    def feed(self, text: str, is_last: bool) -> tuple[str, str]:
        """(content, call text) that ``text``, the next chunk, gives; ``is_last``: the answer ends with it."""
        if self.is_open:
            return "", text
        text, self._held = self._held + text, ""
        if not self.marker:
            if self._is_text or not text:
                return text, ""
            self.is_open, self._is_text = text.startswith("{"), not text.startswith("{")
            return ("", text) if self.is_open else (text, "")
        before, found, after = text.partition(self.marker)
        if found:
            self.is_open = True
            return before, after
        if not is_last:
            keep = next((n for n in range(len(self.marker) - 1, 0, -1) if text.endswith(self.marker[:n])), 0)
            text, self._held = text[: len(text) - keep], text[len(text) - keep :]
        return text, ""
