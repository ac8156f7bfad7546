"""What ``Pipeline`` start loads before any stage runs: the checkpoint, the vision encoder, the engine,
the grammar stage and the model's tool-call format (seconds of synchronous work: run it off the loop).

It loads in two steps so that the processes a pipeline starts load beside it: ``open_model`` checks the
checkpoint can be served and builds the engine process's client (cheap), and ``load_model`` loads the
rest (the tokenizer, the encoder, a thread engine's model, the grammar stage) while the engine process
loads its own model and the preparation workers load theirs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeline.config import PipelineConfig
from pipeline.engine.client import ProcessEngine
from pipeline.engine.factory import Engine, build_process_engine, build_thread_engine
from pipeline.engine.remote_grammar import RemoteGrammarStage, build_remote_grammar_stage
from pipeline.observability.trace import Tracer
from pipeline.protocol.sampling_defaults import SamplingDefaults, read_generation_config
from pipeline.protocol.tool_formats import ToolFormat, tool_format
from pipeline.stage_factory import build_grammar_stage
from sampling.families import family_of
from stages.grammar import GrammarStage
from stages.tokens import single_token_id
from vision.checkpoint import Checkpoint, open_checkpoint
from vision.encoder import VisionEncoder

__all__ = ["LoadedModel", "OpenedModel", "load_model", "open_model"]


@dataclass(frozen=True, slots=True)
class OpenedModel:
    """A checkpoint the pipeline can serve, and its engine process's client (not yet started)."""

    checkpoint: Checkpoint
    engine_process: ProcessEngine | None  # None: a thread engine (load_model builds it), or none
    with_engine: bool

    @property
    def encodes_here(self) -> bool:
        """Whether this process runs the vision encoder (or its preparation workers do): not when the
        engine process encodes (build_process_engine decides), nor for a text-only model."""
        engine_encodes = self.engine_process is not None and self.engine_process.images is not None
        return self.checkpoint.vision_config is not None and not engine_encodes


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """One model's parts, as the pipeline serves them."""

    checkpoint: Checkpoint
    encoder: VisionEncoder | None  # None: a text-only model, or the encoder runs in the engine process
    engine: Engine | None  # None: built without an engine
    grammar: GrammarStage | RemoteGrammarStage
    tool_format: ToolFormat  # how the model writes tool calls: its family's
    sampling_defaults: SamplingDefaults  # the checkpoint's generation_config.json, for unset request fields


def open_model(config: PipelineConfig, *, with_engine: bool, tracer: Tracer | None) -> OpenedModel:
    """Open ``config.model``, check it can be served, and build (not start) its engine process's client.

    :raises UnsupportedModel: an architecture we cannot serve, named, before anything loads.
    """
    ck = open_checkpoint(config.model, config.cache_dir)
    family_of(ck)  # the registry's refusal, before an engine process spends seconds loading it
    process = with_engine and config.engine_mode == "process"
    engine = build_process_engine(ck, config, device=config.resolved_device(), tracer=tracer) if process else None
    return OpenedModel(ck, engine, with_engine)


def load_model(opened: OpenedModel, config: PipelineConfig, *, tracer: Tracer | None) -> LoadedModel:
    """Build the rest of ``opened``'s parts: its encoder, a thread engine, its grammar stage (blocks for
    seconds; an engine process may be starting meanwhile)."""
    device = config.resolved_device()
    ck = opened.checkpoint
    fmt = tool_format(family_of(ck).tool_call_format)
    if fmt.marker is not None and single_token_id(ck.tokenizer, fmt.marker) is None:
        fmt = dataclasses.replace(fmt, marker_is_token=False)  # auto: the grammar spans the answer
    # with the encoder in the engine process, this process loads none (nor, on a GPU, a CUDA context for it)
    encoder = VisionEncoder(ck, device=device) if opened.encodes_here else None
    engine: Engine | None
    grammar: GrammarStage | RemoteGrammarStage
    if opened.engine_process is not None:
        engine = opened.engine_process
        grammar = build_remote_grammar_stage(config, ck, engine)  # the engine process compiles
        # replies read each token's bytes: built here, not by the first reply on the event loop
        engine.build_token_table()
    else:
        engine = build_thread_engine(ck, config, device=device, tracer=tracer) if opened.with_engine else None
        grammar = build_grammar_stage(config, ck)
    return LoadedModel(ck, encoder, engine, grammar, fmt, sampling_defaults(config, ck))


def sampling_defaults(config: PipelineConfig, ck: Checkpoint) -> SamplingDefaults:
    """``config.generation_config``: the checkpoint's file ("auto"), none, or a folder's."""
    choice = config.generation_config
    if choice == "none":
        return SamplingDefaults()
    return read_generation_config(ck.path if choice == "auto" else choice)
