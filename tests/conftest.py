"""Shared fixtures: the embedded default checkpoint, its tokenizer and xgrammar tokenizer info."""

from __future__ import annotations

import os
from typing import Any

import pytest

from pipeline.config import default_cache_dir
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
