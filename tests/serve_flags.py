"""What ``python -m pipeline serve FLAGS`` would configure, without serving: the ``PipelineConfig`` its
flags give."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.config import PipelineConfig


def config_of(flags: list[str], monkeypatch: pytest.MonkeyPatch) -> PipelineConfig:
    """The config ``serve`` would build from ``flags`` (its server replaced by a stub that keeps it)."""
    from pipeline import cli

    seen: list[PipelineConfig] = []

    async def serve(args: Any) -> None:
        seen.append(cli._config(args))

    monkeypatch.setattr(cli, "serve", serve)
    monkeypatch.setattr(cli, "_exit_without_waiting_for_threads", lambda: None)
    assert cli.main(["serve", *flags]) == 0
    return seen[0]
