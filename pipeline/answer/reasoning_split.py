"""A reasoning model's text split where its reasoning ends: what came before is ``reasoning_content``,
what follows is the answer (its content, its tool calls, what its constraint and answer check see).

The split is where the engine saw the end tag as a token (``EngineInput.reasoning_end``, the same
token after which it starts the answer's grammar), so the two agree: a text that merely mentions
``</think>`` in several tokens ends nothing. The tag's own text belongs to neither part, nor does an
open tag the model writes itself first (Qwen3's hybrid template leaves the block to the model).
"""

from __future__ import annotations

from stages.reasoning import ReasoningFormat

__all__ = ["ReasoningSplit"]


class ReasoningSplit:
    """One choice's reasoning, open until its end tag is seen."""

    def __init__(self, tags: ReasoningFormat) -> None:
        self.tags = tags
        self.is_open = True
        self._has_text = False

    def feed(self, token_ids: list[int], text: str) -> tuple[str, list[int], str]:
        """One engine output: its reasoning text, then the token ids and text of the answer that
        follows the end tag (none while the reasoning goes on)."""
        if not self.is_open:
            return "", token_ids, text
        if text and not self._has_text:
            self._has_text = True
            text = text.removeprefix(self.tags.start)
        if self.tags.end_id not in token_ids:
            return text, [], ""
        self.is_open = False
        after_end = token_ids[token_ids.index(self.tags.end_id) + 1 :]
        before, found, after = text.partition(self.tags.end)
        # a tag that writes no text (a tokenizer that marks it special, with special tokens skipped)
        # leaves this output's text to the reasoning
        return (before, after_end, after) if found else (text, after_end, "")
