"""Shared fixtures: the embedded default checkpoint, its tokenizer and xgrammar tokenizer info."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
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
    grammar: Any | None  # xgrammar.CompiledGrammar when it compiled
    error: PipelineError | None  # the 400 it was refused with otherwise


@pytest.fixture(scope="session")
def schema_corpus(tokenizer_info: Any) -> list[CorpusEntry]:
    """The 220 JSONSchemaBench schemas, each compiled once (strict) or refused with its error.

    The slowest schemas take 10-30 s to compile on this hardware, so they are compiled on two threads,
    once per test session, and shared by the grammar tests and the guided-decoding tests.
    """
    import xgrammar as xgr

    from pipeline.request import GrammarSpec
    from stages.grammar import compile_spec

    compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)

    def load(path: Path) -> CorpusEntry:
        raw = json.loads(path.read_text())
        instances = [(bool(t["valid"]), t["data"]) for t in raw.get("tests", [])]
        try:
            grammar = compile_spec(compiler, GrammarSpec("json_schema", raw["schema"]), any_whitespace=False)
            return CorpusEntry(path.stem, raw["schema"], instances, grammar, None)
        except PipelineError as exc:
            return CorpusEntry(path.stem, raw["schema"], instances, None, exc)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(load, sorted(CORPUS_DIR.glob("*.json"))))
