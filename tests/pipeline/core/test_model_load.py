"""The serving side's load: what a reply needs is built there, off the event loop."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from pipeline.config import PipelineConfig
from pipeline.core.model_load import load_model, open_model
from pipeline.engine import factory


def test_the_load_builds_the_token_table_replies_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the engine in its own process, the serving process builds each token's bytes (xgrammar's
    tokenizer info and the table, about 1 s) while it loads, so the first reply does not build it on
    the event loop."""
    built: list[threading.Thread] = []
    original = factory.TokenBytes.from_tokenizer

    def recorded(*args: Any) -> Any:
        built.append(threading.current_thread())
        return original(*args)

    monkeypatch.setattr(factory.TokenBytes, "from_tokenizer", recorded)
    config = PipelineConfig(engine_mode="process")
    opened = open_model(config, with_engine=True, tracer=None)
    assert opened.engine_process is not None and not built  # opening builds nothing yet
    loaded = load_model(opened, config, tracer=None)
    assert built == [threading.current_thread()]  # the load's thread (a worker's, in a pipeline's start)
    table = opened.engine_process.token_table  # what a reply reads: built once, by the load
    assert built == [threading.current_thread()] and len(table) == loaded.checkpoint.text_config.vocab_size
