"""How a chat template takes a message's content: one string, or a list of typed parts.

Templates written for string content (ChatML, Llama 3.x, Hermes, Granite, ...) concatenate
``message['content']`` with text: a list there fails, or prints its repr. Templates written for parts
(Qwen2-VL, Gemma 3, Llama 3.2 Vision, ...) loop over the content or read ``['type']`` of a part. As
vLLM does (``--chat-template-content-format auto``), the template's Jinja AST says which: "openai"
when it iterates over a message's content (or indexes a part of it, or filters its parts), else
"string". A template is parsed once; the answers of per-request templates are kept in a small cache.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Literal, cast

import jinja2
import jinja2.nodes as nodes

from stages.lru import Lru

__all__ = ["CONTENT_FORMATS", "ContentFormat", "ContentFormats", "detect_content_format"]

ContentFormat = Literal["string", "openai"]
CONTENT_FORMATS = ("auto", "string", "openai")

# the filters that pick parts out of a list of parts (``content | selectattr('type', ...)``)
_PART_FILTERS = frozenset({"selectattr", "rejectattr", "map", "groupby", "sort"})
_PART_KEYS = frozenset({"type", "text"})


def _parse(template: str) -> nodes.Template:
    """The template's AST, parsed as transformers compiles it (``{% generation %}`` included).

    :raises ValueError: if the template is not valid Jinja.
    """
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        return _compile_jinja_template(template).environment.parse(template)
    except jinja2.TemplateError as exc:
        raise ValueError(f"the chat template is not valid Jinja: {exc}") from None


def _unwrap(node: nodes.Node) -> nodes.Node:
    """The value under filters, tests and slices: ``messages[1:] | reverse`` is still ``messages``."""
    while True:
        if isinstance(node, nodes.Filter | nodes.Test) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            return node


def _key(node: nodes.Node) -> str | None:
    """The constant key of ``x['key']`` or ``x.key``."""
    if isinstance(node, nodes.Getattr):
        return node.attr
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str):
        return node.arg.value
    return None


def _is_name(node: nodes.Node, names: set[str]) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names


def _assigned_from(ast: nodes.Template, names: set[str], derives: Callable[[nodes.Node, set[str]], bool]) -> set[str]:
    """``names`` and every name set from one of them (``{% set x = ... %}``), transitively."""
    grown = set(names)
    while True:
        new = {
            assign.target.name
            for assign in ast.find_all(nodes.Assign)
            if isinstance(assign.target, nodes.Name) and assign.target.name not in grown and derives(assign.node, grown)
        }
        if not new:
            return grown
        grown |= new


class _Scope:
    """The names a template gives to the conversation, its messages and their content.

    Like vLLM's, a name-based approximation, not a data-flow analysis: after
    ``{% set m = messages[1:] %}``, ``m`` is a list of messages wherever it is read.
    """

    def __init__(self, ast: nodes.Template) -> None:
        self.ast = ast
        self.lists = _assigned_from(ast, {"messages"}, lambda rhs, names: _is_name(_unwrap(rhs), names))
        self.messages = {
            loop.target.name
            for loop in ast.find_all(nodes.For)
            if isinstance(loop.target, nodes.Name) and _is_name(_unwrap(loop.iter), self.lists)
        }
        self.contents = _assigned_from(ast, set(), self._content_of)

    def is_message(self, node: nodes.Node) -> bool:
        """A message: a loop's variable over the messages, or ``messages[i]``."""
        node = _unwrap(node)
        if _is_name(node, self.messages):
            return True
        return isinstance(node, nodes.Getitem) and _key(node) is None and _is_name(_unwrap(node.node), self.lists)

    def _content_of(self, node: nodes.Node, contents: set[str]) -> bool:
        node = _unwrap(node)
        if _is_name(node, contents):
            return True
        return (
            isinstance(node, nodes.Getitem | nodes.Getattr) and _key(node) == "content" and self.is_message(node.node)
        )

    def is_content(self, node: nodes.Node) -> bool:
        """A message's content: ``message['content']``, ``message.content`` or a name set from one."""
        return self._content_of(node, self.contents)


def _uses_parts(scope: _Scope) -> Iterator[nodes.Node]:
    """The nodes that treat a message's content as a list of parts."""
    ast = scope.ast
    for loop in ast.find_all(nodes.For):  # {% for part in message['content'] %}
        if scope.is_content(loop.iter):
            yield loop
    for node in ast.find_all((nodes.Getitem, nodes.Getattr)):  # message['content'][0]['text']
        inner = node.node  # type: ignore[attr-defined]
        if (
            _key(node) in _PART_KEYS
            and isinstance(inner, nodes.Getitem)
            and not isinstance(inner.arg, nodes.Slice)
            and _key(inner) is None
            and scope.is_content(inner.node)
        ):
            yield node
    for node in ast.find_all(nodes.Filter):  # message['content'] | selectattr('type', 'equalto', 'text')
        if node.name in _PART_FILTERS and node.node is not None and scope.is_content(node.node):
            yield node


def detect_content_format(template: str) -> ContentFormat:
    """ "openai" when ``template`` reads a message's content as a list of parts, else "string".

    :raises ValueError: if the template is not valid Jinja.
    """
    return "openai" if next(_uses_parts(_Scope(_parse(template))), None) is not None else "string"


class ContentFormats:
    """The content format of each template a stage renders: ``option`` ("string"/"openai") for all,
    or ("auto") each template's own, detected once and kept (at most ``max_templates``; thread-safe)."""

    def __init__(self, option: str = "auto", *, max_templates: int = 32) -> None:
        if option not in CONTENT_FORMATS:
            raise ValueError(f"content format must be one of {', '.join(CONTENT_FORMATS)}, not {option!r}")
        self.option = option
        self._cache: Lru[str, ContentFormat] = Lru(max_templates)
        self._lock = threading.Lock()

    def of(self, template: str | None) -> ContentFormat:
        """The content format ``template`` gets (None: no template; vLLM gives it strings).

        :raises ValueError: ("auto") if the template is not valid Jinja.
        """
        if self.option != "auto":
            return cast(ContentFormat, self.option)
        if template is None:
            return "string"
        with self._lock:
            known = self._cache.get(template)
        if known is None:
            known = detect_content_format(template)  # parsed outside the lock: ~ms for a long template
            with self._lock:
                self._cache.put(template, known)
        return known
