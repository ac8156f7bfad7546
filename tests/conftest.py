"""Shared fixtures: the embedded default checkpoint, its tokenizer and xgrammar tokenizer info."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import default_cache_dir
from pipeline.errors import PipelineError
from vision.checkpoint import Checkpoint, open_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def checkpoint() -> Checkpoint:
    """The embedded default checkpoint (written into the user cache once per machine)."""
    return open_checkpoint(None, default_cache_dir())


@pytest.fixture(scope="session")
def hf_tokenizer(checkpoint: Checkpoint) -> Any:
    return checkpoint.tokenizer


@pytest.fixture(scope="session")
def tokenizer_info(checkpoint: Checkpoint) -> Any:
    return checkpoint.tokenizer_info


CORPUS_DIR = Path(__file__).resolve().parent / "data" / "jsonschemabench"


@dataclass
class CorpusEntry:
    name: str
    schema: Any
    instances: list[tuple[bool, Any]]  # (valid, data)
    constraint: Any | None  # stages.grammar.CompiledConstraint when it compiled
    error: PipelineError | None  # the 400 it was refused with otherwise

    @property
    def grammar(self) -> Any | None:
        return self.constraint.grammar if self.constraint is not None else None


@pytest.fixture(scope="session")
def grammar_compilers(checkpoint: Checkpoint) -> tuple[Any, Any]:
    """Both grammar backends for the embedded tokenizer (llguidance's tokenizer takes ~2 s to build)."""
    from pipeline.config import PipelineConfig
    from pipeline.stage_factory import build_grammar_stage

    stage = build_grammar_stage(PipelineConfig(), checkpoint)
    return stage.compilers["xgrammar"], stage.compilers["llguidance"]


@pytest.fixture(scope="session")
def schema_corpus(grammar_compilers: tuple[Any, Any]) -> list[CorpusEntry]:
    """The 220 JSONSchemaBench schemas, each compiled once (strict) by the grammar stage, as a
    request's would be, or refused with its error.

    Deterministic: no task group (so no compile races its budget) and slots enough that none is
    ever busy; two compiles at a time, once per test session, shared by the grammar tests.
    """
    import anyio

    from pipeline.types import GrammarSpec
    from stages.grammar import GrammarStage

    stage = GrammarStage(*grammar_compilers, timeout_s=300, max_concurrent=1000)
    paths = sorted(CORPUS_DIR.glob("*.json"))
    entries: dict[Path, CorpusEntry] = {}

    raws = {path: json.loads(path.read_text()) for path in paths}

    async def load(path: Path, limiter: anyio.CapacityLimiter) -> None:
        raw = raws[path]
        instances = [(bool(t["valid"]), t["data"]) for t in raw.get("tests", [])]
        async with limiter:
            try:
                constraint = await stage.compile(GrammarSpec("json_schema", raw["schema"]))
                entries[path] = CorpusEntry(path.stem, raw["schema"], instances, constraint, None)
            except PipelineError as exc:
                entries[path] = CorpusEntry(path.stem, raw["schema"], instances, None, exc)

    async def load_all() -> None:
        limiter = anyio.CapacityLimiter(2)
        async with anyio.create_task_group() as tg:
            for path in paths:
                tg.start_soon(load, path, limiter)

    anyio.run(load_all)
    return [entries[path] for path in paths]
