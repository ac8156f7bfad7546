"""EngineInput: what the request pipeline hands the decode engine, and what comes back."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch

from sampling.logits_process import TokenLogprob
from sampling.params import SamplingParams
from vision.mrope import MRopePositions

__all__ = ["EngineInput", "ImageKey", "SeqOutput"]


@dataclass(frozen=True, slots=True)
class ImageKey:
    """One image of a prompt as the KV prefix cache sees it: its content and its embedding rows."""

    content_hash: str
    num_tokens: int  # its rows in ``image_embeds`` (and image tokens in the prompt), in prompt order
    # its token grid (frames, down, across): where positions depend on it (M-RoPE), so does the K/V
    grid_thw: tuple[int, int, int] | None = None


@dataclass(slots=True)
class EngineInput:
    request_id: str
    prompt_token_ids: list[int]
    image_token_id: int
    image_embeds: torch.Tensor | None  # [num image tokens in the prompt, hidden], or None
    sampling: SamplingParams
    # xgrammar.CompiledGrammar | LLGrammar, or a concurrent.futures.Future of one still compiling: the
    # request then prefills beside the compile and samples once it has ended (sampling/step.py;
    # Sequence.held_for_grammar)
    grammar: Any | None = None
    # the grammar holds only after the sequence emits this token (a tool-call marker); None: from the start
    grammar_trigger: int | None = None
    _: KW_ONLY  # what follows is named: a new field can never shift a caller's positional arguments
    # a reasoning model's answer starts after this token (its end-of-reasoning tag, stages/reasoning.py):
    # the grammar (and its trigger) only from there on; None: the answer starts at the first token
    reasoning_end: int | None = None
    # (backend, GrammarSpec) the grammar was compiled from: what an engine in another process compiles
    # again (a compiled grammar costs 3-20x its compile to serialize)
    grammar_source: tuple[str, Any] | None = None
    # the source's compile had not ended when the request was sent: an engine in another process adds
    # the request at once, with its compile's future as the grammar, instead of holding it until then
    grammar_pending: bool = False
    timings: dict[str, float] = field(default_factory=dict)  # seconds per preparation stage
    # the prompt's images by content, in order; empty: unknown, and KV blocks holding image tokens are
    # then never shared (sampling/prefix_cache.py)
    image_keys: list[ImageKey] = field(default_factory=list)
    # M-RoPE positions of the prompt (3 x L and the decode offset), computed in preparation; None:
    # the 1-D positions (a model without M-RoPE, or a prompt without images)
    mrope: MRopePositions | None = None
    # per-token prefill inputs beside the embeddings, one row per image token like ``image_embeds``
    # (the registry's ``extra_prefill_inputs``: Qwen3-VL's ``deepstack_visual_embeds`` [rows, layers, hidden])
    extra_prefill: dict[str, torch.Tensor] = field(default_factory=dict)
    # the vision encoder in the engine process: each image's pixels (``PreparedImage.pixel_values``),
    # one per image key, for that process to encode; None where it holds the image's embeddings (it
    # then fills ``image_embeds`` and ``extra_prefill`` in). Empty: the embeddings are in ``image_embeds``.
    image_pixels: list[torch.Tensor | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        num_image_tokens = sum(1 for t in self.prompt_token_ids if t == self.image_token_id)
        if self.image_pixels:
            if self.image_embeds is not None or len(self.image_pixels) != len(self.image_keys):
                raise ValueError("image pixels go one per image key, and never beside image embeddings")
            rows = sum(k.num_tokens for k in self.image_keys)
            if rows != num_image_tokens:
                raise ValueError(f"{num_image_tokens} image tokens in the prompt but {rows} image rows")
            return
        rows = 0 if self.image_embeds is None else int(self.image_embeds.shape[0])
        if rows != num_image_tokens:
            raise ValueError(f"{num_image_tokens} image tokens in the prompt but {rows} embedding rows")
        if self.image_keys and sum(k.num_tokens for k in self.image_keys) != rows:
            raise ValueError(f"image keys cover {sum(k.num_tokens for k in self.image_keys)} of {rows} rows")
        if self.mrope is not None and tuple(self.mrope.positions.shape) != (3, len(self.prompt_token_ids)):
            raise ValueError(
                f"M-RoPE positions {tuple(self.mrope.positions.shape)} for {len(self.prompt_token_ids)} tokens"
            )
        for name, extra in self.extra_prefill.items():
            if int(extra.shape[0]) != rows:
                raise ValueError(f"{name} has {int(extra.shape[0])} rows for {rows} image tokens")


@dataclass(slots=True)
class SeqOutput:
    """What one step produced for one sequence (choice ``index`` of request ``request_id``)."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop", "length", "error" or None while running
    error: str | None = None
    num_prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    # "constraint": the grammar engine gave up on the request's constraint (a limit of its parser or
    # lexer), the client's 400; None: any other error, the engine's 500
    error_kind: str | None = None
