"""Template + tokenize: the model's chat template, then image placeholders expanded in id space.

Rendering and tokenizing hold the GIL for milliseconds on long prompts, so they run in a worker
thread under this stage's limiter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio

from pipeline.types import ImagePart, InvalidRequest, Message, PromptTooLong
from stages.offload import Offload
from vision.preprocess import ImageGrid, ImageTokenIds, expand_image_tokens

__all__ = ["TemplateStage"]


def _to_hf_messages(messages: tuple[Message, ...]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        content = [
            {"type": "image"} if isinstance(part, ImagePart) else {"type": "text", "text": part.text}
            for part in message.parts
        ]
        out.append({"role": message.role, "content": content})
    return out


class TemplateStage:
    name = "template"

    def __init__(
        self, tokenizer: Any, image_ids: ImageTokenIds, *, max_prompt_tokens: int, threads: int, inline: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.image_ids = image_ids
        self.max_prompt_tokens = max_prompt_tokens
        self.offload = Offload(anyio.CapacityLimiter(threads), inline=inline)
        self.limiter = self.offload.limiter

    def render(self, messages: tuple[Message, ...], images: Sequence[ImageGrid]) -> list[int]:
        """Prompt token ids with every image expanded to its grid of image tokens (synchronous).

        :raises InvalidRequest: if the template rejects the conversation or text mimics an image token.
        :raises PromptTooLong: if the prompt exceeds ``max_prompt_tokens``.
        """
        try:
            text = self.tokenizer.apply_chat_template(_to_hf_messages(messages), tokenize=False)
        except Exception as exc:  # jinja's raise_exception: the template's own rules (roles, order)
            raise InvalidRequest(f"the chat template rejected the conversation: {exc}", field="messages") from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        try:
            ids = expand_image_tokens(ids, images, self.image_ids)
        except ValueError as exc:
            raise InvalidRequest(
                f"image placeholders do not match the images ({exc}); text may not contain '[IMG]'",
                field="messages",
            ) from None
        if len(ids) > self.max_prompt_tokens:
            raise PromptTooLong(
                f"the prompt is {len(ids)} tokens; at most {self.max_prompt_tokens} are allowed", field="messages"
            )
        return ids

    async def run(self, messages: tuple[Message, ...], images: Sequence[ImageGrid]) -> list[int]:
        """Render and tokenize in a worker thread (finishes even if the caller is cancelled)."""
        return await self.offload.run(self.render, messages, images)
