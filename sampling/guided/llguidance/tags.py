"""xgrammar 0.2's structural tags as llguidance Lark grammars, for the formats whose meaning Lark
says exactly; anything else is refused (``NotTranslatable``) and stays xgrammar's.

Translated: ``const_string``, ``json_schema`` (JSON style, xgrammar's compact layout), ``regex``,
``sequence``, ``or``, ``tag``, ``optional``, ``plus``, ``star``, and ``triggered_tags`` at the top
(free text, then tags each entered by its trigger; neither ``at_least_one``, ``stop_after_first``
nor ``excludes``), as llguidance's own ``StructTag`` writes them: the text before a trigger is a
lazy lexeme, so it ends at the first trigger.

Text that the tokenizer writes as one special token (Hermes' ``<tool_call>`` and ``</tool_call>`` in
Qwen's tokenizers) is written as that token (``<[id]>``), never as a string: llguidance's lexer
reads a special token as no text, so a string ``"</tool_call>"`` refused the token its mask allowed.
A trigger is either plain text or one special token, never a part of one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import llguidance

__all__ = ["NotTranslatable", "structural_tag_to_lark"]

# the JSON layout of xgrammar's any_whitespace=False (sampling/guided/llguidance/backend.py's JSON options)
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_REPEATS = {"optional": "?", "plus": "+", "star": "*"}


class NotTranslatable(ValueError):
    """A structural tag (or part of one) that has no exact Lark translation here."""


def structural_tag_to_lark(tag: dict[str, Any], special_tokens: Mapping[str, int] | None = None) -> str:
    """The Lark grammar of ``tag`` (xgrammar 0.2's ``{"type": "structural_tag", "format": ...}``);
    ``special_tokens`` maps the text of each special token the tokenizer writes to its id.

    :raises NotTranslatable: naming the format that has no translation.
    """
    fmt = tag.get("format")
    if not isinstance(fmt, dict):
        raise NotTranslatable("a structural tag needs a format")
    lark = _Lark(special_tokens or {})
    if fmt.get("type") == "triggered_tags":
        return lark.triggered_tags(fmt)
    return f"start: {lark.expr(fmt)}\n"


def _string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class _Lark:
    """The translation for one tokenizer: its special tokens become token references."""

    def __init__(self, special_tokens: Mapping[str, int]) -> None:
        self.special_tokens = special_tokens
        # longest first: a special token whose text holds a shorter one's is matched whole
        names = sorted(special_tokens, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None

    def literal(self, text: str) -> str:
        """``text`` as Lark: strings, and ``<[id]>`` where the tokenizer writes a special token."""
        if self._split is None:
            return _string(text)
        parts = [p for p in self._split.split(text) if p]
        refs = [f"<[{self.special_tokens[p]}]>" if p in self.special_tokens else _string(p) for p in parts]
        return refs[0] if len(refs) == 1 else "(" + " ".join(refs) + ")"

    def _ends_inside(self, text: str, at: int) -> bool:
        """Whether position ``at`` of ``text`` falls inside one of its special tokens."""
        return self._split is not None and any(m.start() < at < m.end() for m in self._split.finditer(text))

    def end(self, end: Any) -> str:
        if isinstance(end, list):
            return "(" + " | ".join(self.literal(e) for e in end) + ")" if end else '""'
        return self.literal(end) if end else ""

    @staticmethod
    def _schema(fmt: dict[str, Any]) -> str:
        if fmt.get("style", "json") != "json" or fmt.get("any_order") or fmt.get("excludes"):
            raise NotTranslatable("a json_schema format with a style, any_order or excludes")
        schema = fmt["json_schema"]
        schema = {} if schema is True else schema
        if not isinstance(schema, dict) or "x-guidance" in schema:
            raise NotTranslatable("a json_schema format whose schema is not an object")
        return "%json " + json.dumps({**schema, "x-guidance": _COMPACT}, ensure_ascii=False)

    def expr(self, fmt: dict[str, Any]) -> str:
        """One format as a Lark expression."""
        kind = fmt.get("type")
        if kind == "const_string":
            return self.literal(fmt["value"]) if fmt["value"] else '""'
        if kind == "json_schema":
            return self._schema(fmt)
        if kind == "regex":
            return f"/{llguidance.regex_to_lark(fmt['pattern'], 'dw')}/"
        if kind == "sequence":
            return "(" + " ".join(self.expr(e) for e in fmt["elements"]) + ")"
        if kind == "or":
            return "(" + " | ".join(self.expr(e) for e in fmt["elements"]) + ")"
        if kind == "tag":
            parts = [
                self.literal(fmt["begin"]) if fmt["begin"] else "",
                self.expr(fmt["content"]),
                self.end(fmt["end"]),
            ]
            return "(" + " ".join(p for p in parts if p) + ")"
        if kind in ("optional", "plus", "star"):
            return f"({self.expr(fmt['content'])}){_REPEATS[kind]}"
        raise NotTranslatable(f"a {kind} format")

    def triggered_tags(self, fmt: dict[str, Any]) -> str:
        if fmt.get("at_least_one") or fmt.get("stop_after_first") or fmt.get("excludes"):
            raise NotTranslatable("triggered_tags with at_least_one, stop_after_first or excludes")
        triggers: list[str] = fmt["triggers"]
        rules = []
        for i, tag in enumerate(fmt["tags"]):
            begin: str = tag["begin"]
            trigger = next(t for t in triggers if begin.startswith(t))  # exactly one (checked at admission)
            after = begin[len(trigger) :]
            rest = [self.literal(after) if after else "", self.expr(tag["content"]), self.end(tag["end"])]
            if trigger in self.special_tokens:
                # no text holds a special token, so the free text before it ends there unaided
                rules.append(f"tag_{i}: TAG_TEXT <[{self.special_tokens[trigger]}]> " + " ".join(p for p in rest if p))
                continue
            if self._split is not None and self._split.search(trigger):
                raise NotTranslatable("triggered_tags with a trigger of text and special tokens")
            if self._ends_inside(begin, len(trigger)):
                # the tag's special token would be spelled in pieces: the token itself is no text
                raise NotTranslatable("triggered_tags with a trigger that ends inside a special token")
            rules.append(f"tag_{i}_trig[lazy]: TAG_TEXT {_string(trigger)}")
            rules.append(f"tag_{i}: tag_{i}_trig " + " ".join(p for p in rest if p))
        options = " | ".join(f"tag_{i}" for i in range(len(fmt["tags"])))
        head = [f"start: ({options})* TAG_TEXT", r"TAG_TEXT: /(.|\n)*/"]
        return "\n".join([*head, *rules]) + "\n"
