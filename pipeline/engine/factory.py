"""Builds the decode engine of a checkpoint from a PipelineConfig (the engine itself knows no config)."""

from __future__ import annotations

import functools
from typing import cast

import torch

from pipeline.config import PipelineConfig
from pipeline.engine.client import ProcessEngine
from pipeline.engine.images import ImageIndex
from pipeline.engine.spec import EngineProcessSpec, SpanBuffer
from pipeline.errors import PromptTooLong
from pipeline.observability.trace import Tracer
from sampling.async_engine import AsyncEngine
from sampling.compiled import CompileMode, is_compile_wanted, use_inductor_cache
from sampling.detokenizer import TokenBytes
from sampling.engine import LLMEngine
from sampling.families import build_runner
from sampling.kv_cache import blocks_needed
from sampling.model_runner import ModelRunner
from sampling.paged_runner import PagedRunner
from stages.tokens import text_ids
from vision.checkpoint import Checkpoint
from vision.encoder import embedding_row_bytes

__all__ = [
    "Engine",
    "build_llm_engine",
    "build_process_engine",
    "build_thread_engine",
    "check_fits",
    "num_kv_blocks",
]

Engine = AsyncEngine | ProcessEngine  # the pipeline uses both through the same calls


def num_kv_blocks(config: PipelineConfig) -> int:
    """KV cache blocks of the engine ``config`` builds (default: max_running_seqs of max_model_len / 4)."""
    return config.num_kv_blocks or config.max_running_seqs * blocks_needed(
        config.max_model_len // 4, config.kv_block_size
    )


def check_fits(config: PipelineConfig, num_prompt: int, n: int, max_tokens: int, where: str = "messages") -> None:
    """Refuse (400) a request the engine ``config`` builds could never run, before more work is done
    (``where``: the field that holds the prompt).

    :raises PromptTooLong: no room to generate within max_model_len; ``n`` copies of the prompt need
        more KV blocks than the whole cache has; or one sequence may outgrow the whole cache before
        ``max_tokens`` (possible only with a cache smaller than max_model_len). The engine would
        fail each of these with a 500, the last one mid-answer.
    """
    if num_prompt >= config.max_model_len:
        raise PromptTooLong(
            f"the prompt is {num_prompt} tokens; max_model_len is {config.max_model_len}, "
            "which must leave room for at least one generated token",
            field=where,
        )
    block, held = config.kv_block_size, num_kv_blocks(config)
    need = blocks_needed(num_prompt + 1, block) * n
    if need > held:
        raise PromptTooLong(
            f"{n} sequence(s) of this {num_prompt}-token prompt need {need * block} tokens of KV cache; "
            f"the whole cache holds {held * block}",
            field="n" if n > 1 else where,
        )
    longest = min(num_prompt + max_tokens, config.max_model_len)
    if blocks_needed(longest, block) > held:
        raise PromptTooLong(
            f"this {num_prompt}-token prompt plus max_tokens may grow to {longest} tokens; the whole KV cache "
            f"holds {held * block}",
            field="max_tokens",
        )


def build_llm_engine(
    checkpoint: Checkpoint,
    config: PipelineConfig,
    *,
    device: str,
    tracer: Tracer | SpanBuffer | None = None,
    record_timeline: bool = False,
    runner: PagedRunner | None = None,
) -> LLMEngine:
    """The synchronous engine core of ``checkpoint``, sized by ``config`` (benchmarks drive it directly);
    ``runner``: the model and KV cache of another engine built from the same config, to share."""
    tokenizer_info = checkpoint.tokenizer_info
    num_blocks = num_kv_blocks(config)
    if runner is None:
        runner = build_runner(
            checkpoint,
            impl=config.model_impl,  # type: ignore[arg-type]  # checked by PipelineConfig
            device=device,
            max_model_len=config.max_model_len,
            num_blocks=num_blocks,
            block_size=config.kv_block_size,
            dtype=None if config.dtype == "auto" else getattr(torch, config.dtype),
        )
        mode = cast(CompileMode, config.compile_model)  # checked by PipelineConfig
        if is_compile_wanted(mode, runner.device):
            use_inductor_cache(config.cache_dir)
            runner.compile_decode()
            runner.warm_up_decode()  # compiles here, in the engine's start, not in a request's step
    return LLMEngine(
        cast(ModelRunner, runner),  # the engine uses only the PagedRunner interface both runners share
        TokenBytes.from_tokenizer(tokenizer_info, checkpoint.tokenizer),
        eos_token_ids=[int(t) for t in tokenizer_info.stop_token_ids],
        num_blocks=num_blocks,
        max_running=config.max_running_seqs,
        chunk_tokens=config.prefill_chunk_tokens,
        chunk_tokens_with_decodes=config.prefill_chunk_tokens_with_decodes,
        decode_steps_per_prefill=config.decode_steps_per_prefill,
        max_prefill_seqs=config.prefill_seqs_per_step,
        mixed_chunk_tokens=config.mixed_chunk_tokens,
        record_timeline=record_timeline or config.record_step_timeline,
        tracer=tracer,
        one_step_ahead=config.engine_one_step_ahead,
        prefix_caching=config.prefix_caching,
        forced_tokens=config.forced_tokens,
        decode_buffers=config.decode_buffers,
        encode=functools.partial(text_ids, checkpoint.tokenizer),
    )


def build_process_engine(
    checkpoint: Checkpoint, config: PipelineConfig, *, device: str, tracer: Tracer | None = None
) -> ProcessEngine:
    """The client of ``checkpoint``'s engine process (``engine_mode`` "process"), sized by ``config``;
    ``start()`` starts the process, which loads the model (and, per ``config``, the vision encoder)."""
    encodes = config.encoder_in_engine() and checkpoint.vision_config is not None
    spec = EngineProcessSpec(config, str(checkpoint.path), device, trace=tracer is not None, encodes=encodes)
    row_bytes = embedding_row_bytes(checkpoint, device)
    return ProcessEngine(
        spec,
        queue_size=config.engine_queue_size,
        step_timeout_s=config.engine_step_timeout_s,
        start_timeout_s=config.engine_start_timeout_s,
        retry_after_s=config.retry_after_s,
        token_table=functools.cache(
            lambda: TokenBytes.from_tokenizer(checkpoint.tokenizer_info, checkpoint.tokenizer).table
        ),
        tracer=tracer,
        images=ImageIndex(config.encoder_cache_bytes, row_bytes) if encodes else None,
    )


def build_thread_engine(
    checkpoint: Checkpoint, config: PipelineConfig, *, device: str, tracer: Tracer | None = None
) -> AsyncEngine:
    """``checkpoint``'s decode engine on a thread of this process (``engine_mode`` "thread"), sized by
    ``config`` (loads the model: seconds)."""
    engine = build_llm_engine(checkpoint, config, device=device, tracer=tracer)
    return AsyncEngine(engine, queue_size=config.engine_queue_size)
