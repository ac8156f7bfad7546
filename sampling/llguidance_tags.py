"""xgrammar 0.2's structural tags as llguidance Lark grammars, for the formats whose meaning Lark
says exactly; anything else is refused (``NotTranslatable``) and stays xgrammar's.

Translated: ``const_string``, ``json_schema`` (JSON style, xgrammar's compact layout), ``regex``,
``sequence``, ``or``, ``tag``, ``optional``, ``plus``, ``star``, and ``triggered_tags`` at the top
(free text, then tags each entered by its trigger; neither ``at_least_one``, ``stop_after_first``
nor ``excludes``), as llguidance's own ``StructTag`` writes them: the text before a trigger is a
lazy lexeme, so it ends at the first trigger.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

__all__ = ["NotTranslatable", "structural_tag_to_lark"]

# the JSON layout of xgrammar's any_whitespace=False (sampling/llguidance_backend.py's JSON options)
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_REPEATS = {"optional": "?", "plus": "+", "star": "*"}


class NotTranslatable(ValueError):
    """A structural tag (or part of one) that has no exact Lark translation here."""


def structural_tag_to_lark(tag: dict[str, Any]) -> str:
    """The Lark grammar of ``tag`` (xgrammar 0.2's ``{"type": "structural_tag", "format": ...}``).

    :raises NotTranslatable: naming the format that has no translation.
    """
    fmt = tag.get("format")
    if not isinstance(fmt, dict):
        raise NotTranslatable("a structural tag needs a format")
    if fmt.get("type") == "triggered_tags":
        return _triggered_tags(fmt)
    return f"start: {_expr(fmt)}\n"


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _end(end: Any) -> str:
    if isinstance(end, list):
        return "(" + " | ".join(_literal(e) for e in end) + ")" if end else '""'
    return _literal(end) if end else ""


def _schema(fmt: dict[str, Any]) -> str:
    if fmt.get("style", "json") != "json" or fmt.get("any_order") or fmt.get("excludes"):
        raise NotTranslatable("a json_schema format with a style, any_order or excludes")
    schema = fmt["json_schema"]
    schema = {} if schema is True else schema
    if not isinstance(schema, dict) or "x-guidance" in schema:
        raise NotTranslatable("a json_schema format whose schema is not an object")
    return "%json " + json.dumps({**schema, "x-guidance": _COMPACT}, ensure_ascii=False)


def _expr(fmt: dict[str, Any]) -> str:
    """One format as a Lark expression."""
    kind = fmt.get("type")
    if kind == "const_string":
        return _literal(fmt["value"]) if fmt["value"] else '""'
    if kind == "json_schema":
        return _schema(fmt)
    if kind == "regex":
        return f"/{llguidance.regex_to_lark(fmt['pattern'], 'dw')}/"
    if kind == "sequence":
        return "(" + " ".join(_expr(e) for e in fmt["elements"]) + ")"
    if kind == "or":
        return "(" + " | ".join(_expr(e) for e in fmt["elements"]) + ")"
    if kind == "tag":
        parts = [_literal(fmt["begin"]) if fmt["begin"] else "", _expr(fmt["content"]), _end(fmt["end"])]
        return "(" + " ".join(p for p in parts if p) + ")"
    if kind in ("optional", "plus", "star"):
        return f"({_expr(fmt['content'])}){_REPEATS[kind]}"
    raise NotTranslatable(f"a {kind} format")


def _triggered_tags(fmt: dict[str, Any]) -> str:
    if fmt.get("at_least_one") or fmt.get("stop_after_first") or fmt.get("excludes"):
        raise NotTranslatable("triggered_tags with at_least_one, stop_after_first or excludes")
    triggers: list[str] = fmt["triggers"]
    rules = []
    for i, tag in enumerate(fmt["tags"]):
        begin: str = tag["begin"]
        trigger = next(t for t in triggers if begin.startswith(t))  # exactly one (checked at admission)
        rest = [_literal(begin[len(trigger) :]) if begin != trigger else "", _expr(tag["content"]), _end(tag["end"])]
        rules.append(f"tag_{i}_trig[lazy]: TAG_TEXT {_literal(trigger)}")
        rules.append(f"tag_{i}: tag_{i}_trig " + " ".join(p for p in rest if p))
    options = " | ".join(f"tag_{i}" for i in range(len(fmt["tags"])))
    head = [f"start: ({options})* TAG_TEXT", r"TAG_TEXT: /(.|\n)*/"]
    return "\n".join([*head, *rules]) + "\n"
