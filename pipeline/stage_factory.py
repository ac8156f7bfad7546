"""Builds the preparation stages of a checkpoint from a PipelineConfig (the stages themselves know no config).

``pipeline.core.preparation`` owns the stages built here and carries requests through them; the engine
process builds its grammar stage here too (``pipeline.engine.grammars``), so this module sits below both.
"""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path
from typing import Any

import torch

from pipeline.config import PipelineConfig
from sampling.guided.llguidance.backend import LLGuidanceBackend
from stages.decode import DecodeStage
from stages.encoder_cache import EncoderCache
from stages.fetch import FetchStage
from stages.grammar import GrammarStage
from stages.grammar.backends import LLGuidanceCompiler, XGrammarCompiler
from stages.grammar.limits import GrammarLimits
from stages.process_pool import ImagePool
from stages.reasoning import ReasoningFormat, detect_reasoning_parser, reasoning_format
from stages.template import TemplateStage
from stages.vision_encode import VisionEncodeStage
from vision.checkpoint import Checkpoint
from vision.encoder import VisionEncoder
from vision.image_text import ImageText
from vision.image_worker import ImageWorkerSpec
from vision.preprocess import ImageTokenIds, preprocess_image, target_longest_edge

__all__ = [
    "build_decode_stage",
    "build_encoder_cache",
    "build_fetch_stage",
    "build_grammar_stage",
    "build_image_pool",
    "build_template_stage",
    "build_vision_stage",
    "encoder_cache_namespace",
    "grammar_limits",
    "llguidance_backend",
]


def build_grammar_stage(config: PipelineConfig, checkpoint: Checkpoint) -> GrammarStage:
    """The grammar stage with both backends for ``checkpoint``'s tokenizer (seconds: run it off the loop)."""
    return GrammarStage(
        XGrammarCompiler(checkpoint.tokenizer_info, any_whitespace=config.json_any_whitespace),
        LLGuidanceCompiler(llguidance_backend(checkpoint)),
        timeout_s=config.grammar_compile_timeout_s,
        cache_bytes=config.grammar_cache_bytes,
        max_concurrent=config.grammar_max_concurrent_compiles,
        backend=config.grammar_backend,
        abandon_on_shutdown=config.grammar_abandon_on_shutdown,
        limits=grammar_limits(config),
    )


def grammar_limits(config: PipelineConfig) -> GrammarLimits:
    """What one constraint may hold, from ``config``'s ``grammar_*`` bounds."""
    return GrammarLimits(
        max_bytes=config.grammar_max_bytes,
        max_schema_nodes=config.grammar_max_schema_nodes,
        max_schema_depth=config.grammar_max_schema_depth,
        max_enum_values=config.grammar_max_enum_values,
        max_literal_bytes=config.grammar_max_literal_bytes,
        max_grammar_rules=config.grammar_max_rules,
        max_regex_bytes=config.grammar_max_regex_bytes,
        max_nesting=config.grammar_max_nesting,
    )


def llguidance_backend(checkpoint: Checkpoint) -> LLGuidanceBackend:
    """llguidance's backend for ``checkpoint``'s tokenizer."""
    info = checkpoint.tokenizer_info
    return LLGuidanceBackend(
        checkpoint.tokenizer, vocab_size=info.vocab_size, stop_token_ids=[int(t) for t in info.stop_token_ids]
    )


def encoder_cache_namespace(checkpoint: Checkpoint) -> str:
    """The model and processor part of an encoder cache key: embeddings of one model and one set of
    processor settings are never served for another."""
    processor = checkpoint.image_processor
    settings = processor.to_json_string() if processor is not None else ""
    return hashlib.sha256(f"{checkpoint.path}\n{settings}".encode()).hexdigest()[:16]


def build_fetch_stage(cfg: PipelineConfig) -> FetchStage:
    """The fetch stage: image bytes by URL, data URL or path under ``media_root``."""
    return FetchStage(
        max_bytes=cfg.max_image_bytes,
        concurrency=cfg.fetch_concurrency,
        per_request=cfg.fetch_concurrency_per_request,
        per_host=cfg.fetch_concurrency_per_host,
        connect_timeout_s=cfg.fetch_connect_timeout_s,
        total_timeout_s=cfg.fetch_total_timeout_s,
        max_redirects=cfg.max_redirects,
        allow_private=cfg.allow_private_networks,
        media_root=cfg.media_root,
    )


def build_image_pool(cfg: PipelineConfig, checkpoint: Checkpoint, *, encodes_here: bool) -> ImagePool | None:
    """The worker processes of process mode (for a model that takes images); ``encodes_here``: the
    serving process's side runs the vision encoder (not the engine process)."""
    if cfg.preparation_mode != "process" or cfg.inline_preparation or checkpoint.image_processor is None:
        return None
    # The encoder runs in the workers when it runs on the CPU: there it is GIL-free torch work
    # like the rest, at low priority. On a GPU it stays in this process, on the device, where
    # its micro-batches share the device with the decode engine and need no copy of the weights.
    spec = ImageWorkerSpec(
        checkpoint_path=str(checkpoint.path),
        max_pixels=cfg.max_image_pixels,
        target_longest_edge=target_longest_edge(checkpoint.image_processor),
        encode=encodes_here and torch.device(cfg.resolved_device()).type == "cpu",
        nice=cfg.prep_worker_nice,
        task=cfg.prep_worker_task,
    )
    return ImagePool(
        spec,
        size=cfg.num_prep_workers(),
        max_image_bytes=cfg.max_image_bytes,
        job_timeout_s=cfg.prep_worker_timeout_s,
    )


def build_decode_stage(
    cfg: PipelineConfig, processor: Any, longest_edge: int | None, pool: ImagePool | None
) -> DecodeStage:
    """The decode stage: image bytes to preprocessed pixels, in ``pool``'s workers when there is one."""
    return DecodeStage(
        max_pixels=cfg.max_image_pixels,
        threads=cfg.decode_threads,
        inline=cfg.inline_preparation,
        target_longest_edge=longest_edge,
        transform=partial(preprocess_image, processor) if processor else None,
        pool=pool,
    )


def chat_template_text(given: str | None) -> str | None:
    """``--chat-template``'s value as a template: Jinja text as given (it holds a ``{``), else the
    text of the file it names.

    :raises ValueError: a file that cannot be read, named.
    """
    if given is None or "{" in given:
        return given
    try:
        return Path(given).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"the chat template file {given!r} cannot be read: {exc.strerror or exc}") from None


def build_reasoning_format(cfg: PipelineConfig, tokenizer: Any) -> ReasoningFormat | None:
    """How the model's reasoning is told from its answer: ``cfg.reasoning_parser``, or ("auto") the
    parser its tokenizer and chat template call for; None: the whole text is the answer.

    :raises ValueError: a parser the model's tokenizer cannot write (its tags are not single tokens).
    """
    name = cfg.reasoning_parser
    if name == "auto":
        try:
            template = tokenizer.get_chat_template(chat_template_text(cfg.chat_template))
        except (ValueError, AttributeError):  # no template (raw prompts only), or no HF tokenizer
            return None
        found = detect_reasoning_parser(tokenizer, str(template))
        return reasoning_format(found, tokenizer) if found is not None else None
    return None if name == "none" else reasoning_format(name, tokenizer)


def build_template_stage(
    cfg: PipelineConfig, tokenizer: Any, image_token_id: int, image_text: ImageText | None = None
) -> TemplateStage:
    """The template stage: messages to prompt token ids (``image_token_id`` < 0: a model without images;
    ``image_text``: a layout expanded in text, Gemma 3's)."""
    return TemplateStage(
        tokenizer,
        ImageTokenIds.from_tokenizer(tokenizer, image_token_id) if image_token_id >= 0 else None,
        max_prompt_tokens=cfg.max_prompt_tokens,
        threads=cfg.template_threads,
        inline=cfg.inline_preparation,
        image_text=image_text,
        content_format=cfg.chat_template_content_format,
        chat_template=chat_template_text(cfg.chat_template),
        sanitize_control_tokens=not cfg.allow_control_tokens_in_content,
        large_request_chars=cfg.template_large_request_chars,
    )


def build_vision_stage(cfg: PipelineConfig, encoder: VisionEncoder | None) -> VisionEncodeStage | None:
    """The vision-encode stage (None for a model that takes no images)."""
    return (
        VisionEncodeStage(
            encoder,
            max_batch=cfg.vision_max_batch,
            wait_ms=cfg.vision_batch_wait_ms,
            queue_size=cfg.stage_queue_size * cfg.max_images_per_request,
            threads=cfg.vision_encode_threads,
            inline=cfg.inline_preparation,
        )
        if encoder is not None
        else None
    )


def build_encoder_cache(cfg: PipelineConfig, checkpoint: Checkpoint) -> EncoderCache[Any] | None:
    """The encoder cache (None when off, or for a model that takes no images); with the encoder in
    the engine process, it keeps the images' pixels (their embeddings are kept there)."""
    if not cfg.encoder_cache_bytes or checkpoint.vision_config is None:
        return None
    return EncoderCache(cfg.encoder_cache_bytes, encoder_cache_namespace(checkpoint))
