"""Reasoning models: which parser a checkpoint takes, and whether a prompt leaves the model reasoning.

Qwen3, QwQ and the DeepSeek-R1 family write their reasoning between ``<think>`` and ``</think>``
before the answer. Some templates open the block in the generation prompt (DeepSeek-R1 distills,
QwQ, Qwen3's thinking releases: the model writes only the closing tag), Qwen3's hybrid template lets
the model open it itself, and closes an empty one in the prompt when ``enable_thinking`` is false.
A parser here is the pair of tags and their token ids; the engine starts a request's constraint after
the end tag (``EngineInput.reasoning_end``), and the answer's assembly returns what comes before it
as ``reasoning_content`` (pipeline/answer/reasoning_split.py).

Whether a prompt leaves the model reasoning is read from the prompt's ids, from the end back to the
first control token: an open tag there means the template opened the block; a closing tag means it
closed it (thinking off, or a continued answer); anything else (the generation prompt's own
markers) means the model starts afresh and, being a reasoning model, opens the block itself. Only the
last turn is read, so a reasoning block kept in an earlier assistant turn never decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stages.tokens import single_token_id

__all__ = ["PARSERS", "ReasoningFormat", "detect_reasoning_parser", "reasoning_format"]

# parser name -> (start tag, end tag); the names are vLLM's, so its users' flags work here
PARSERS: dict[str, tuple[str, str]] = {
    "deepseek_r1": ("<think>", "</think>"),  # DeepSeek-R1 and its distills, QwQ, Qwen3 thinking releases
    "qwen3": ("<think>", "</think>"),  # Qwen3's hybrid models (``enable_thinking``)
}


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """One model's reasoning tags, as text and as its tokenizer's single tokens."""

    name: str
    start: str
    end: str
    start_id: int
    end_id: int
    # the tokenizer's added and special tokens: reading a prompt back stops at the first (see the module)
    control_ids: frozenset[int]

    def open_at_start(self, prompt_ids: list[int]) -> bool:
        """Whether a model prompted with ``prompt_ids`` writes reasoning before its answer: False
        only when the prompt's last turn closed the block already."""
        for token in reversed(prompt_ids):
            if token == self.end_id:
                return False
            if token == self.start_id or token in self.control_ids:
                return True
        return True


def reasoning_format(name: str, tokenizer: Any) -> ReasoningFormat:
    """Parser ``name`` over ``tokenizer``'s tokens.

    :raises ValueError: an unknown name, or a tokenizer that writes a tag in several tokens.
    """
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}: choose one of {sorted(PARSERS)} or 'none'")
    start, end = PARSERS[name]
    start_id, end_id = single_token_id(tokenizer, start), single_token_id(tokenizer, end)
    if start_id is None or end_id is None:
        raise ValueError(f"reasoning parser {name!r} needs {start} and {end} as single tokens of the model's tokenizer")
    # every added token, special or not: DeepSeek-R1's turn markers (<｜Assistant｜>) are not marked special
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    controls = {int(t) for t in (*getattr(tokenizer, "all_special_ids", ()), *added)} - {start_id, end_id}
    return ReasoningFormat(name, start, end, start_id, end_id, frozenset(controls))


def detect_reasoning_parser(tokenizer: Any, chat_template: str | None) -> str | None:
    """The parser a checkpoint's tokenizer and chat template call for, None for a model that does not
    reason: its tokenizer has both tags as single tokens, and its template either opens the block in
    its generation prompt (``deepseek_r1``) or has the ``enable_thinking`` switch (``qwen3``). A
    template that only strips ``<think>`` blocks from history (Qwen3's instruct releases) is not one."""
    start, end = PARSERS["deepseek_r1"]
    if not chat_template or single_token_id(tokenizer, start) is None or single_token_id(tokenizer, end) is None:
        return None
    prompt = _generation_prompt(tokenizer, chat_template)
    if prompt is not None and prompt.rfind(start) > prompt.rfind(end):
        return "deepseek_r1"
    if "enable_thinking" in chat_template and start in chat_template:
        return "qwen3"
    return None


def _generation_prompt(tokenizer: Any, chat_template: str) -> str | None:
    """What the template adds to open the assistant's turn after a one-message conversation (None:
    it would not render one)."""
    conversation = [{"role": "user", "content": "Hi"}]
    try:
        opened = tokenizer.apply_chat_template(
            conversation, chat_template=chat_template, tokenize=False, add_generation_prompt=True
        )
        closed = tokenizer.apply_chat_template(
            conversation, chat_template=chat_template, tokenize=False, add_generation_prompt=False
        )
    except Exception:  # a template that refuses this conversation says nothing about reasoning
        return None
    return str(opened)[len(str(closed)) :] if str(opened).startswith(str(closed)) else None
