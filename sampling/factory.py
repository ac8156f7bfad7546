"""Builds the engine of a checkpoint from a PipelineConfig."""

from __future__ import annotations

from typing import Any

from pipeline.config import PipelineConfig
from sampling.async_engine import AsyncEngine
from sampling.detokenizer import TokenBytes
from sampling.engine import LLMEngine
from sampling.kv_cache import blocks_needed
from sampling.model_runner import ModelRunner
from vision.checkpoint import Checkpoint

__all__ = ["build_engine"]


def build_engine(checkpoint: Checkpoint, tokenizer_info: Any, config: PipelineConfig, *, device: str) -> AsyncEngine:
    """The decode engine on its own thread, sized by ``config``."""
    num_blocks = config.num_kv_blocks or config.max_running_seqs * blocks_needed(
        config.max_model_len // 4, config.kv_block_size
    )
    runner = ModelRunner(
        checkpoint,
        device=device,
        max_model_len=config.max_model_len,
        num_blocks=num_blocks,
        block_size=config.kv_block_size,
    )
    eos = [int(t) for t in tokenizer_info.stop_token_ids]
    engine = LLMEngine(
        runner,
        TokenBytes.from_tokenizer(tokenizer_info, checkpoint.tokenizer),
        eos_token_ids=eos,
        num_blocks=num_blocks,
        max_running=config.max_running_seqs,
        chunk_tokens=config.prefill_chunk_tokens,
    )
    return AsyncEngine(engine, queue_size=config.engine_queue_size)
