"""Template + tokenize: the model's chat template, then image placeholders expanded in id space.

Rendering and tokenizing hold the GIL for milliseconds on long prompts, so they run in a worker
thread under this stage's limiter.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import anyio

from pipeline.errors import InvalidRequest, PromptTooLong
from pipeline.types import ImagePart, Message
from stages.offload import Offload
from vision.image_text import ImageText
from vision.preprocess import ImageGrid, ImageTokenIds, expand_image_tokens

__all__ = ["TemplateStage", "single_token_id"]

# A normalizer may shrink a text before it is split into tokens (NFC composes up to three code
# points into one): the character bound on a prompt leaves this much room for it.
_SHRINK_ROOM = 4


def single_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of ``tokenizer``'s one token whose text is ``text``; None when it writes it in several."""
    token = tokenizer.convert_tokens_to_ids(text)
    return None if token is None or token == tokenizer.unk_token_id else int(token)


def _arguments(text: str) -> Any:
    """A call's arguments as templates take them: an object where the JSON text is one (Llama 3.1's
    template writes ``arguments | tojson``, which would quote a string), else the text itself."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _to_hf_messages(messages: tuple[Message, ...]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for message in messages:
        content: Any = [
            {"type": "image"} if isinstance(part, ImagePart) else {"type": "text", "text": part.text}
            for part in message.parts
        ]
        if message.role == "tool":  # templates read a tool result as one string
            content = "".join(part.text for part in message.parts if not isinstance(part, ImagePart))
        hf: dict[str, Any] = {"role": message.role, "content": content or None}
        if message.tool_calls:
            hf["tool_calls"] = [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": _arguments(arguments)}}
                for call_id, name, arguments in message.tool_calls
            ]
        if message.tool_call_id is not None:
            hf["tool_call_id"] = message.tool_call_id
        out.append(hf)
    return out


class TemplateStage:
    name = "template"

    def __init__(
        self,
        tokenizer: Any,
        image_ids: ImageTokenIds | None,
        *,
        max_prompt_tokens: int,
        threads: int,
        inline: bool = False,
        image_text: ImageText | None = None,
    ) -> None:
        """``image_ids``: the image token layout, None for a model that takes no images;
        ``image_text``: a layout the processor expands in text before tokenizing (Gemma 3)."""
        self.tokenizer = tokenizer
        self.image_ids = image_ids
        self.image_text = image_text
        self.max_prompt_tokens = max_prompt_tokens
        self.offload = Offload(anyio.CapacityLimiter(threads), inline=inline)
        self.limiter = self.offload.limiter
        # read at start (about 0.1 s for a 131k vocabulary), not by the first request's template step
        self._longest_token = self._longest_token_of(tokenizer)

    @staticmethod
    def _longest_token_of(tokenizer: Any) -> int | None:
        """The characters of the longest vocabulary entry: no token writes more of the text (a
        byte-level entry has a character per byte); None: the tokenizer lists no vocabulary."""
        vocab = getattr(tokenizer, "get_vocab", None)
        return max(map(len, vocab()), default=1) if callable(vocab) else None

    def _check_chars(self, text: str, where: str) -> None:
        """:raises PromptTooLong: a text longer than ``max_prompt_tokens`` tokens could write,
        refused before tokenizing it (tens of megabytes of text: a minute and gigabytes to count)."""
        longest = self._longest_token
        if longest is not None and len(text) > self.max_prompt_tokens * longest * _SHRINK_ROOM:
            raise PromptTooLong(
                f"the prompt is {len(text)} characters, more than {self.max_prompt_tokens} tokens can hold; "
                f"at most {self.max_prompt_tokens} tokens are allowed",
                field=where,
            )

    @functools.cache  # noqa: B019 - one stage per model, a few marker texts
    def marker_token(self, marker: str | None) -> int | None:
        """The id of the token whose text is ``marker`` (a tool-call marker), None when the tokenizer
        has no such single token (it would write the text in several)."""
        return None if marker is None else single_token_id(self.tokenizer, marker)

    @functools.cache  # noqa: B019 - one stage per model, a few marker texts
    def marker_ids(self, marker: str) -> tuple[int, ...]:
        """The token ids that write ``marker``: its one token, else its tokenization."""
        token = single_token_id(self.tokenizer, marker)
        return (token,) if token is not None else tuple(self.tokenizer.encode(marker, add_special_tokens=False))

    def render(
        self,
        messages: tuple[Message, ...],
        images: Sequence[ImageGrid],
        tools: tuple[dict[str, Any], ...] = (),
        prompt: str | list[int] | None = None,
        prompt_field: str = "prompt",
    ) -> list[int]:
        """Prompt token ids with every image expanded to its grid of image tokens (synchronous);
        ``tools`` go to the template, a raw ``prompt`` (text or ids) replaces the template, and its
        errors name ``prompt_field``.

        :raises InvalidRequest: if the template rejects the conversation or text mimics an image token.
        :raises PromptTooLong: if the prompt exceeds ``max_prompt_tokens``.
        """
        where = "messages" if prompt is None else prompt_field
        if isinstance(prompt, list):
            vocab = len(self.tokenizer)
            if not all(0 <= t < vocab for t in prompt):
                raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", field=where)
            ids = list(prompt)
            if self.image_text is not None:
                ids = self._expanded(self.image_text.expand_ids, ids, images, self.tokenizer, where=where)
        elif prompt is not None:
            self._check_chars(prompt, where)
            ids = self.tokenizer.encode(self._expand_text(prompt, images, where), add_special_tokens=True)
            bos = self.tokenizer.bos_token_id
            if bos is not None and ids[:1] != [bos]:  # as the chat template starts: some tokenizers add none
                ids.insert(0, bos)
        else:
            try:
                # the prompt ends where the assistant's answer starts (its header, for templates that have one)
                text = self.tokenizer.apply_chat_template(
                    _to_hf_messages(messages), tools=list(tools) or None, tokenize=False, add_generation_prompt=True
                )
            except Exception as exc:  # jinja's raise_exception: the template's own rules (roles, order)
                raise InvalidRequest(f"the chat template rejected the conversation: {exc}", field="messages") from None
            self._check_chars(text, where)
            ids = self.tokenizer.encode(self._expand_text(text, images, where), add_special_tokens=False)
        if self.image_ids is None:
            if images:
                raise InvalidRequest("this model takes no images", field=where)
            return self._check_length(ids, where)
        if self.image_text is not None:  # expanded already, in text
            if ids.count(self.image_ids.image) != len(images) * self.image_text.num_tokens:
                raise InvalidRequest("the text may not contain image tokens", field=where)
            return self._check_length(ids, where)
        try:
            ids = expand_image_tokens(ids, images, self.image_ids)
        except ValueError as exc:
            token = self.tokenizer.convert_ids_to_tokens(self.image_ids.image)
            raise InvalidRequest(
                f"image placeholders do not match the images ({exc}); text may not contain {token!r}",
                field=where,
            ) from None
        return self._check_length(ids, where)

    def _expand_text(self, text: str, images: Sequence[ImageGrid], where: str) -> str:
        if self.image_text is None or self.image_ids is None:
            return text
        return self._expanded(self.image_text.expand_text, text, images, where=where)

    @staticmethod
    def _expanded(expand: Any, *args: Any, where: str) -> Any:
        try:
            return expand(*args)
        except ValueError as exc:
            raise InvalidRequest(f"image placeholders do not match the images ({exc})", field=where) from None

    def _check_length(self, ids: list[int], where: str) -> list[int]:
        if len(ids) > self.max_prompt_tokens:
            raise PromptTooLong(
                f"the prompt is {len(ids)} tokens; at most {self.max_prompt_tokens} are allowed", field=where
            )
        return ids

    async def run(
        self,
        messages: tuple[Message, ...],
        images: Sequence[ImageGrid],
        tools: tuple[dict[str, Any], ...] = (),
        prompt: str | list[int] | None = None,
        prompt_field: str = "prompt",
    ) -> list[int]:
        """Render and tokenize in a worker thread (finishes even if the caller is cancelled)."""
        return await self.offload.run(self.render, messages, images, tools, prompt, prompt_field)
