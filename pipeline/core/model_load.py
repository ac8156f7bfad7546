"""What ``Pipeline`` start loads before any stage runs: the checkpoint, the vision encoder, the engine,
the grammar stage and the model's tool-call format (seconds of synchronous work: run it off the loop)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeline.config import PipelineConfig
from pipeline.core.engine_client import ProcessEngine
from pipeline.core.engine_factory import Engine, build_engine
from pipeline.core.remote_grammar import RemoteGrammarStage, build_remote_grammar_stage
from pipeline.core.stage_factory import build_grammar_stage
from pipeline.observability.trace import Tracer
from pipeline.protocol.tool_formats import ToolFormat, tool_format
from sampling.families import family_of
from stages.grammar import GrammarStage
from stages.template import single_token_id
from vision.checkpoint import Checkpoint, open_checkpoint
from vision.encoder import VisionEncoder

__all__ = ["LoadedModel", "load_model"]


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """One model's parts, as the pipeline serves them."""

    checkpoint: Checkpoint
    encoder: VisionEncoder | None  # None: a text-only model, or the encoder runs in the engine process
    engine: Engine | None  # None: built without an engine
    grammar: GrammarStage | RemoteGrammarStage
    tool_format: ToolFormat  # how the model writes tool calls: its family's


def load_model(config: PipelineConfig, *, with_engine: bool, tracer: Tracer | None) -> LoadedModel:
    """Open ``config.model`` and build its encoder, engine and grammar stage (blocks for seconds).

    :raises UnsupportedModel: an architecture we cannot serve, named, before anything loads.
    """
    device = config.resolved_device()
    ck = open_checkpoint(config.model, config.cache_dir)
    fmt = tool_format(family_of(ck).tool_call_format)
    if fmt.marker is not None and single_token_id(ck.tokenizer, fmt.marker) is None:
        fmt = dataclasses.replace(fmt, marker_is_token=False)  # auto: the grammar spans the answer
    # with the encoder in the engine process, this process loads none (nor, on a GPU, a CUDA context for it)
    encodes_here = ck.vision_config is not None and not (with_engine and config.encoder_in_engine())
    encoder = VisionEncoder(ck, device=device) if encodes_here else None
    engine = build_engine(ck, config, device=device, tracer=tracer) if with_engine else None
    grammar: GrammarStage | RemoteGrammarStage
    if isinstance(engine, ProcessEngine):
        grammar = build_remote_grammar_stage(config, ck, engine)  # the engine process compiles
    else:
        grammar = build_grammar_stage(config, ck)
    return LoadedModel(ck, encoder, engine, grammar, fmt)
