"""Control tokens in what a request sends, encoded as text: only the chat template writes them.

A message's text is the client's, an end user's or a tool's; the template's markers (``[INST]``,
``<|im_start|>``, ``</s>``) are the model's. Encoded with special-token parsing on, as transformers
and vLLM encode a rendered prompt by default, ``<|im_end|>`` typed inside a tool result becomes the
real token, and the result can close its turn and open one of its own. So, as transformers'
``apply_chat_template(..., sanitize_control_tokens=True)`` does, every control token (the
tokenizer's special tokens, and its added tokens the template's text writes) found in the request's
strings is wrapped in private-use markers before rendering; the rendered prompt is then encoded with
each marked token as plain text and the rest as before. A conversation without control-token text
renders to the same text, so it gets the same ids as without marking.

One step more than transformers: a template that prints a client's value with Python's repr (Llama
3.2 Vision and Llama 4 print the first user message's list of parts so, when tools are given) or as
ASCII-only JSON escapes the markers and leaves the token between them bare, where transformers
encodes it as the token; such an escaped pair counts as markers here too.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any

# transformers' own pieces of sanitize_control_tokens (private names: transformers is pinned, and the
# tests compare the prompts with its apply_chat_template, so a change in them shows)
from transformers.utils.chat_template_utils import (
    _CONTROL_TOKEN_END,
    _CONTROL_TOKEN_START,
    _encode_chat_piece,
    mark_control_tokens,
)

from pipeline.errors import InvalidRequest, PromptTooLong
from stages.lru import Lru

__all__ = ["MARK_START", "ControlTokens", "Marker", "no_marking", "trie_pattern"]

# what opens a marked control token in a rendered prompt (transformers' private-use marker)
MARK_START = _CONTROL_TOKEN_START
_MARKERS = (_CONTROL_TOKEN_START, _CONTROL_TOKEN_END)
# the markers as Python's repr and ASCII-only JSON write them
_ESCAPED_START = r"(?:\\U000f0000|\\udb80\\udc00)"
_ESCAPED_END = r"(?:\\U000f0001|\\udb80\\udc01)"

Marker = Callable[[Any], Any]


def no_marking(value: Any) -> Any:
    return value


def trie_pattern(words: Iterable[str]) -> re.Pattern[str]:
    """A regex that matches any of ``words``, the longest where several start at one place.

    Written as a trie: a flat alternation of tekken's 1,000 special tokens tries each of them at every
    ``<`` and took 1.2 s to scan 200,000 of them (this: milliseconds).
    """
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}

    def branch(node: dict[str, Any]) -> str:
        alternatives = [re.escape(char) + branch(child) for char, child in node.items() if char]
        if not alternatives:
            return ""
        body = alternatives[0] if len(alternatives) == 1 else f"(?:{'|'.join(alternatives)})"
        return f"(?:{body})?" if "" in node else body  # greedy: the longer word first

    return re.compile(branch(trie) or "(?!)")


def _marked(value: Any, pattern: re.Pattern[str]) -> Any:
    """``value`` with the control tokens in its strings marked, dict keys included (transformers'
    ``mark_control_tokens`` leaves keys: a tool's parameter may be named ``<|im_end|>``)."""
    if isinstance(value, str):
        return mark_control_tokens(value, pattern)
    if isinstance(value, dict):
        return {_marked(key, pattern): _marked(item, pattern) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_marked(item, pattern) for item in value]
    return value


class ControlTokens:
    """Marks the control tokens in a request's strings and encodes a prompt rendered from them
    (thread-safe; one per tokenizer)."""

    def __init__(self, tokenizer: Any, *, max_templates: int = 32) -> None:
        self.tokenizer = tokenizer
        self._patterns: Lru[str, re.Pattern[str]] = Lru(max_templates)
        self._lock = threading.Lock()
        tokens = trie_pattern(tokenizer.added_tokens_encoder).pattern
        start, end = _MARKERS
        # [text, marked token, text, ...]; None for a lone marker (a template's split() cut a pair)
        self._pieces = re.compile(f"{start}({tokens}){end}|[{start}{end}]")
        self._escaped = re.compile(f"{_ESCAPED_START}({tokens}){_ESCAPED_END}")
        self._newline = list(tokenizer.encode("\n", add_special_tokens=False))
        self._as_text: dict[str, list[int]] = {}  # a marked token's ids: at most one entry per added token

    def marker(self, template: str) -> Marker:
        """What marks the control tokens of ``template``'s tokenizer in a string, list or dict."""
        return functools.partial(_marked, pattern=self._pattern(template))

    def _pattern(self, template: str) -> re.Pattern[str]:
        with self._lock:
            known = self._patterns.get(template)
        if known is None:
            # the template's literal text decides which non-special added tokens it writes (transformers' rule)
            known = trie_pattern(self.tokenizer._get_control_tokens(template))
            with self._lock:
                self._patterns.put(template, known)
        return known

    def encode(self, text: str, *, max_tokens: int, where: str) -> list[int]:
        """The ids of ``text``, rendered from marked strings, as transformers' ``encode_marked_chat``
        writes them: marked control tokens as plain text, each piece between them as the tokenizer
        encodes it; errors name ``where``.

        :raises PromptTooLong: if the marked tokens alone write more than ``max_tokens`` tokens,
            before the pieces between them are encoded (each its own call).
        :raises InvalidRequest: if the tokenizer writes a marked token's text as that token even as text.
        """
        text = self._escaped.sub(lambda m: f"{_MARKERS[0]}{m.group(1)}{_MARKERS[1]}", text)
        if not any(marker in text for marker in _MARKERS):
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        pieces = self._pieces.split(text)
        marked = [self._text_ids(token, where) for token in pieces[1::2] if token]
        num_marked = sum(map(len, marked))
        if num_marked > max_tokens:
            raise PromptTooLong(
                f"the prompt's control-token text alone is {num_marked} tokens; at most {max_tokens} are allowed",
                field=where,
            )
        ids = list(self.tokenizer.encode(pieces[0], add_special_tokens=False))
        next_marked = iter(marked)
        for index in range(1, len(pieces)):
            piece = pieces[index]
            if not piece:
                continue
            if index % 2:
                ids += next(next_marked)
            else:
                ids += _encode_chat_piece(self.tokenizer, piece, False, self._newline)
        return ids

    def _text_ids(self, token: str, where: str) -> list[int]:
        """The ids that write ``token``'s text as text (kept: the same few tokens come back).

        :raises InvalidRequest: if the tokenizer writes it as the token itself even as text.
        """
        known = self._as_text.get(token)
        if known is None:
            known = list(_encode_chat_piece(self.tokenizer, token, True, self._newline))
            if self.tokenizer.convert_tokens_to_ids(token) in known:
                raise InvalidRequest(f"{token!r} cannot be written as text with this tokenizer", field=where)
            self._as_text[token] = known
        return known
