"""Template + tokenize: the model's chat template, then image placeholders expanded in id space.

Each template gets a message's content in the form its author wrote it for, one string or a list of
parts (``stages/chat_format.py``, decided once per template), and a request's own options (its
template, template variables, an open final turn, truncation) as vLLM reads them. Control-token
text in what the request wrote is encoded as text (``stages/control_tokens.py``) unless the stage is
told to allow it. Rendering and tokenizing hold the GIL for milliseconds on long prompts, so they run
in a worker thread under this stage's limiter.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import anyio
import jinja2

from pipeline.errors import InvalidRequest, PromptTooLong
from pipeline.types import Message, TemplateOptions
from stages.chat_format import ContentFormat, ContentFormats
from stages.chat_messages import image_placeholder_of, to_template_messages
from stages.control_tokens import MARK_START, ControlTokens, no_marking
from stages.offload import Offload
from stages.template_options import reserved_template_names, template_kwargs, truncate_prompt
from stages.tokens import single_token_id, with_bos
from vision.image_text import ImageText
from vision.preprocess import ImageGrid, ImageTokenIds, expand_image_tokens

__all__ = ["TemplateStage"]

# A normalizer may shrink a text before it is split into tokens (NFC composes up to three code
# points into one): the character bound on a prompt leaves this much room for it.
_SHRINK_ROOM = 4
_DEFAULTS = TemplateOptions()


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
        content_format: str = "auto",
        chat_template: str | None = None,
        image_placeholder: str | None = None,
        sanitize_control_tokens: bool = True,
        large_request_chars: int = 256 * 1024,
    ) -> None:
        """``image_ids``: the image token layout, None for a model that takes no images;
        ``image_text``: a layout the processor expands in text before tokenizing (Gemma 3);
        ``content_format``: how templates take a message's content ("auto": each template's own,
        "string" or "openai" for all); ``chat_template``: a template that replaces the tokenizer's;
        ``image_placeholder``: what a string-format template gets for an image (None: the model's own);
        ``sanitize_control_tokens``: control-token text in messages, tools and template variables is
        encoded as text (False: as the tokens it spells, transformers' and vLLM's default);
        ``large_request_chars``: a prompt of more (``is_large``) is rendered in the large lane.

        :raises ValueError: if ``content_format`` is unknown, or ("auto") the template is not valid Jinja.
        """
        self.tokenizer = tokenizer
        self.image_ids = image_ids
        self.image_text = image_text
        self.max_prompt_tokens = max_prompt_tokens
        self.offload = Offload(anyio.CapacityLimiter(threads), inline=inline)
        self.limiter = self.offload.limiter
        # the large lane: a thread of its own for large prompts (``run(large=True)``), so that small ones
        # never wait behind them (the tokenizer lets go of the GIL while it encodes)
        self.large_offload = Offload(anyio.CapacityLimiter(1), inline=inline)
        self.large_request_chars = large_request_chars
        # read at start (about 0.1 s for a 131k vocabulary), not by the first request's template step
        self._longest_token = self._longest_token_of(tokenizer)
        self.chat_template = chat_template
        self.image_placeholder = image_placeholder or image_placeholder_of(tokenizer, image_ids, image_text)
        self._span_tokens = self._span_tokens_of(tokenizer, image_ids, self.image_placeholder)
        self._reserved = reserved_template_names(tokenizer)
        self.formats = ContentFormats(content_format)
        # decided here, once, for the template most requests use (the server logs it)
        default_template = self._default_template()
        self.content_format: ContentFormat = self.formats.of(default_template)
        self.control_tokens = ControlTokens(tokenizer) if sanitize_control_tokens else None
        if self.control_tokens is not None and default_template is not None:
            self.control_tokens.marker(default_template)  # about 0.1 s for 1,000 special tokens: at start

    def _default_template(self) -> str | None:
        try:
            return str(self.tokenizer.get_chat_template(self.chat_template))
        except ValueError:  # no template: only raw prompts can be served
            return None

    @staticmethod
    def _span_tokens_of(tokenizer: Any, image_ids: ImageTokenIds | None, placeholder: str | None) -> frozenset[int]:
        """The ids an image's span is written with: its layout's tokens and its placeholder's markers."""
        if image_ids is None:
            return frozenset()
        layout = {image_ids.image, image_ids.row_break, image_ids.image_end} - {None}
        markers = tokenizer.encode(placeholder, add_special_tokens=False) if placeholder else []
        return frozenset(int(t) for t in (*layout, *markers) if t is not None)

    @staticmethod
    def _longest_token_of(tokenizer: Any) -> int | None:
        """The characters of the longest vocabulary entry: no token writes more of the text (a
        byte-level entry has a character per byte); None: the tokenizer lists no vocabulary."""
        vocab = getattr(tokenizer, "get_vocab", None)
        return max(map(len, vocab()), default=1) if callable(vocab) else None

    def is_large(self, render_chars: int) -> bool:
        """Whether a prompt of ``render_chars`` (``ChatRequest.render_chars``) goes to the large lane."""
        return render_chars > self.large_request_chars

    @property
    def max_text_chars(self) -> int | None:
        """Characters of text that ``max_prompt_tokens`` tokens cannot write, whatever the text (None:
        unknown); admission checks a conversation's text against it before rendering."""
        longest = self._longest_token
        return None if longest is None else self.max_prompt_tokens * longest * _SHRINK_ROOM

    def _check_chars(self, text: str, where: str) -> None:
        """:raises PromptTooLong: a text longer than ``max_prompt_tokens`` tokens could write,
        refused before tokenizing it (tens of megabytes of text: a minute and gigabytes to count)."""
        bound = self.max_text_chars
        if bound is not None and len(text) > bound:
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
        options: TemplateOptions | None = None,
    ) -> list[int]:
        """Prompt token ids with every image expanded to its grid of image tokens (synchronous);
        ``tools`` go to the template, a raw ``prompt`` (text or ids) replaces the template, and its
        errors name ``prompt_field``; ``options``: the request's own template options.

        :raises InvalidRequest: if the template rejects the conversation, text mimics an image token,
            or an option is refused (naming it).
        :raises PromptTooLong: if the prompt exceeds ``max_prompt_tokens``.
        """
        options = options or _DEFAULTS
        where = "messages" if prompt is None else prompt_field
        if self.image_ids is None and images:
            raise InvalidRequest("this model takes no images", field=where)
        if isinstance(prompt, list):
            vocab = len(self.tokenizer)
            if not all(0 <= t < vocab for t in prompt):
                raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", field=where)
            ids = list(prompt)
            if self.image_text is not None:
                ids = self._expanded(self.image_text.expand_ids, ids, images, self.tokenizer, where=where)
        elif prompt is not None:
            self._check_chars(prompt, where)
            text = self._expand_text(prompt, images, where)
            ids = with_bos(self.tokenizer, self.tokenizer.encode(text, add_special_tokens=True))
        else:
            text = self.render_text(messages, tools, options)
            self._check_chars(text, where)
            text = self._expand_text(text, images, where, typed=True)
            if self.control_tokens is None:
                ids = self.tokenizer.encode(text, add_special_tokens=False)
            else:
                ids = self.control_tokens.encode(text, max_tokens=self.max_prompt_tokens, where=where)
        ids = self._with_images(ids, images, where)
        image_token = self.image_ids.image if self.image_ids is not None else None
        ids = truncate_prompt(
            ids, options.truncate_prompt_tokens, self.max_prompt_tokens, image_token, self._span_tokens
        )
        return self._check_length(ids, where)

    def render_text(
        self, messages: tuple[Message, ...], tools: tuple[dict[str, Any], ...], options: TemplateOptions
    ) -> str:
        """The conversation through its chat template, each message's content in the template's format.

        :raises InvalidRequest: naming the option, the message or the template the request is refused for.
        """
        if options.continue_final_message and options.add_generation_prompt:
            raise InvalidRequest(
                "continue_final_message and add_generation_prompt cannot both be true: the prompt either leaves "
                "the last message open or opens a new assistant turn",
                field="continue_final_message",
            )
        kwargs = template_kwargs(options.kwargs, self._reserved)
        tool_list = list(tools) or None
        field = "chat_template" if options.chat_template is not None else "messages"
        try:
            # a tokenizer may keep several named templates: the tool one when tools are given
            template = str(self.tokenizer.get_chat_template(options.chat_template or self.chat_template, tool_list))
            content_format = self.formats.of(template)
            mark = self.control_tokens.marker(template) if self.control_tokens is not None else no_marking
        except ValueError as exc:
            raise InvalidRequest(f"no chat template to render the conversation: {exc}", field=field) from None
        except jinja2.TemplateSyntaxError as exc:
            raise InvalidRequest(f"the chat template is not valid Jinja: {exc}", field=field) from None
        conversation = to_template_messages(messages, content_format, self.image_placeholder, mark)
        try:
            return str(
                self.tokenizer.apply_chat_template(
                    conversation,
                    tools=mark(tool_list),
                    chat_template=template,
                    tokenize=False,
                    add_generation_prompt=options.add_generation_prompt,
                    continue_final_message=options.continue_final_message,
                    **mark(kwargs),
                )
            )
        except jinja2.TemplateSyntaxError as exc:
            raise InvalidRequest(f"the chat template is not valid Jinja: {exc}", field=field) from None
        except Exception as exc:  # jinja's raise_exception: the template's own rules (roles, order)
            raise InvalidRequest(f"the chat template rejected the conversation: {exc}", field="messages") from None

    def _with_images(self, ids: list[int], images: Sequence[ImageGrid], where: str) -> list[int]:
        """``ids`` with each image placeholder expanded to its image's tokens (done already, in text, for
        a layout expanded in text).

        :raises InvalidRequest: if the placeholders do not match the images, or text mimics an image token.
        """
        if self.image_ids is None:
            return ids
        if self.image_text is not None:
            if ids.count(self.image_ids.image) != len(images) * self.image_text.num_tokens:
                raise InvalidRequest("the text may not contain image tokens", field=where)
            return ids
        try:
            return expand_image_tokens(ids, images, self.image_ids)
        except ValueError as exc:
            token = self.tokenizer.convert_ids_to_tokens(self.image_ids.image)
            raise InvalidRequest(
                f"image placeholders do not match the images ({exc}); text may not contain {token!r}",
                field=where,
            ) from None

    def _expand_text(self, text: str, images: Sequence[ImageGrid], where: str, *, typed: bool = False) -> str:
        """``text`` with a layout expanded in text; ``typed``: text rendered from marked strings,
        whose marked placeholders are the client's text, not images."""
        if self.image_text is None or self.image_ids is None:
            return text
        after = MARK_START if typed and self.control_tokens is not None else None
        return self._expanded(self.image_text.expand_text, text, images, where=where, typed_after=after)

    @staticmethod
    def _expanded(expand: Any, *args: Any, where: str, **kwargs: Any) -> Any:
        try:
            return expand(*args, **kwargs)
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
        options: TemplateOptions | None = None,
        *,
        large: bool = False,
    ) -> list[int]:
        """Render and tokenize in a worker thread (finishes even if the caller is cancelled); ``large``:
        in the large lane's."""
        lane = self.large_offload if large else self.offload
        return await lane.run(self.render, messages, images, tools, prompt, prompt_field, options)
