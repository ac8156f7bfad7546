"""The decode engine as the pipeline runs it: its own process (``server``, started by
``process_main``), the serving process's side of it (``client``: the link, the supervisor that restarts
it, the arena its adds' tensors cross in, the messages in ``wire``), the grammars and images it keeps,
the grammar stage that compiles there (``remote_grammar``), and the factory that builds either engine
from a ``PipelineConfig``.

Above it sits the core (``pipeline.core``); below it the stage factory, the wire protocol,
observability and the config. It imports nothing of the core: ``make check`` holds the direction.
"""

from __future__ import annotations

from pipeline.engine.client import ProcessEngine
from pipeline.engine.factory import Engine, build_llm_engine, build_process_engine, build_thread_engine, check_fits
from pipeline.engine.remote_grammar import RemoteGrammarStage, build_remote_grammar_stage

__all__ = [
    "Engine",
    "ProcessEngine",
    "RemoteGrammarStage",
    "build_llm_engine",
    "build_process_engine",
    "build_remote_grammar_stage",
    "build_thread_engine",
    "check_fits",
]
